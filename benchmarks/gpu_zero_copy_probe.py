"""Probe: can a kernel read the pinned host tier in place (UVA zero-copy), and how fast?

Usage (GPU machine): python benchmarks/gpu_zero_copy_probe.py
"""

from __future__ import annotations

import time

import torch
import triton
import triton.language as tl


@triton.jit
def _gather_rows(src_ptr, dst_ptr, rows_ptr, row_elems, CHUNK: tl.constexpr):
    pair = tl.program_id(0)
    part = tl.program_id(1)
    row = tl.load(rows_ptr + pair).to(tl.int64)
    offs = part * CHUNK + tl.arange(0, CHUNK)
    mask = offs < row_elems
    vals = tl.load(src_ptr + row * row_elems + offs, mask=mask)
    tl.store(dst_ptr + pair.to(tl.int64) * row_elems + offs, vals, mask=mask)


class _HostView:
    def __init__(self, t: torch.Tensor) -> None:
        self.__cuda_array_interface__ = {
            "shape": tuple(t.shape),
            "typestr": "<i2",
            "data": (t.data_ptr(), False),
            "version": 3,
        }


def main() -> None:
    rows, row_elems = 4096, 32 * 1024  # 4096 rows of 64 KB (one layer's K+V of one 8B block)
    host = torch.randint(-1000, 1000, (rows, row_elems), dtype=torch.int16).pin_memory()
    pick = torch.randperm(rows)[:480].sort().values
    want = host[pick]
    for name, src in (("pinned cpu tensor", host), ("cuda view via array interface", None)):
        try:
            if src is None:
                src = torch.as_tensor(_HostView(host), device="cuda")
                print("view device:", src.device, src.shape, src.dtype)
            dst = torch.empty((480, row_elems), dtype=torch.int16, device="cuda")
            ids = pick.to(torch.int32).cuda()
            grid = (480, triton.cdiv(row_elems, 4096))
            _gather_rows[grid](src, dst, ids, row_elems, CHUNK=4096)
            torch.cuda.synchronize()
            ok = torch.equal(dst.cpu(), want)
            t = []
            for _ in range(10):
                s = time.perf_counter()
                _gather_rows[grid](src, dst, ids, row_elems, CHUNK=4096)
                torch.cuda.synchronize()
                t.append(time.perf_counter() - s)
            gb = 480 * row_elems * 2 / 1e9
            print(
                f"{name}: correct={ok} {gb / sorted(t)[5]:.1f} GB/s ({sorted(t)[5] * 1e3:.2f} ms)"
            )
        except Exception as exc:  # noqa: BLE001
            print(f"{name}: failed: {type(exc).__name__}: {str(exc)[:200]}")
    dev = torch.empty((480, row_elems), dtype=torch.int16, device="cuda")
    pinned = want.pin_memory()
    t = []
    for _ in range(10):
        s = time.perf_counter()
        dev.copy_(pinned, non_blocking=True)
        torch.cuda.synchronize()
        t.append(time.perf_counter() - s)
    rate = 480 * row_elems * 2 / 1e9 / sorted(t)[5]
    print(f"plain H2D of the same bytes (pinned, contiguous): {rate:.1f} GB/s")


if __name__ == "__main__":
    main()
