"""The MLP's gate/up projection of a long prefill with SiLU(gate) x up in its epilogue: one Triton
matmul on Hopper instead of cuBLAS's and a pass over its output.

At 8,192 rows of an 8B model the gate/up product is [8192, 28672] in bf16, 470 MB written by the
matmul and read again by SiLU x up (`elementwise_kernels.silu_mul`), which writes its 235 MB
half: ~170-240 us a layer at the copy rate. Here each program's accumulator holds gate and up
columns side by side and the epilogue writes only SiLU(gate) x up. The weight stays the fused
[gate | up] rows every other path reads; it is seen as [2, N, K], and one tensor-memory load
takes the same `HALF` rows of both halves at once:

    w        [2, N, K]       gate rows w[0], up rows w[1] (a torch Linear's weight, contiguous)
    load     [2, HALF, BK]   w[0, n : n + HALF] and w[1, n : n + HALF]: one box, one accumulator
    acc      [BM, 2 x HALF]  x @ that^T in float32: gate columns, then up columns
    out      [BM, HALF]      SiLU(gate) x up, rounded once

Programs stay resident, one per SM, taking tiles in turn, with warp specialization (loads in
their own warps, ahead of the matmuls). On an H200 (a throwaway probe, the kernel and cuBLAS +
`silu_mul` called in turn, 8B shapes): 2,890-2,909 us against 3,031 at 8,192 rows; level at
3,000 (1,082 against 1,079); slower at 512 (206 against 188), so only chunks of at least
`MIN_ROWS` take it. Its error against float64 is 1.8e-3 against 6.5e-3 for the two steps (SiLU
of the float32 accumulator, one rounding). Imported only on CUDA; needs tensor-memory loads and
warp specialization (`usable`).
"""

from __future__ import annotations

import functools
import inspect

import torch
import triton
import triton.language as tl

__all__ = ["MIN_ROWS", "fits", "silu_gate_matmul", "usable"]

MIN_ROWS = 4096
"""Fewest rows this matmul is used for: below it cuBLAS + `silu_mul` is as fast or faster."""

_BM, _HALF, _BK, _WARPS, _STAGES, _GROUP_M = 128, 128, 64, 8, 4, 8


def usable(device: torch.device) -> bool:
    """A Hopper (or newer) card and a Triton with host tensor descriptors and warp
    specialization."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (9, 0):
        return False
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return "warp_specialize" in inspect.signature(tl.range).parameters


def fits(hidden_size: int) -> bool:
    """Whether a model of this hidden size (the matmul's K) can take this matmul."""
    return hidden_size % 8 == 0


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def silu_gate_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """SiLU(x @ gate^T) x (x @ up^T) for a fused [gate | up] weight w [2N, K]: [rows, N] in x's
    dtype. K a multiple of 8 (rows of 16 bytes, `fits`)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    rows, k = x.shape
    if w.shape[0] % 2 or w.shape[1] != k:
        raise ValueError(f"weight {tuple(w.shape)} is no [2N, {k}] gate/up pair")
    if not fits(k):
        raise ValueError(f"K = {k} is no multiple of 8")
    x, w = x.contiguous(), w.contiguous()  # (both already are in the layers: no copy)
    n = w.shape[0] // 2
    out = torch.empty((rows, n), device=x.device, dtype=x.dtype)
    num_tiles = triton.cdiv(rows, _BM) * triton.cdiv(n, _HALF)
    sms = _num_sms(x.device.index if x.device.index is not None else torch.cuda.current_device())
    _silu_gate_kernel[(min(sms, num_tiles),)](
        TensorDescriptor.from_tensor(x, [_BM, _BK]),
        TensorDescriptor.from_tensor(w.view(2, n, k), [2, _HALF, _BK]),
        TensorDescriptor.from_tensor(out, [_BM, _HALF]),
        rows,
        n,
        k,
        BM=_BM,
        HALF=_HALF,
        BK=_BK,
        GROUP_M=_GROUP_M,
        NUM_SMS=sms,
        STAGES=_STAGES,
        num_warps=_WARPS,
    )
    return out


@triton.jit
def _silu_gate_kernel(
    x_desc,
    w_desc,
    out_desc,
    rows,
    n,
    k,
    BM: tl.constexpr,
    HALF: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_SMS: tl.constexpr,
    STAGES: tl.constexpr,
):
    num_m = tl.cdiv(rows, BM)
    num_n = tl.cdiv(n, HALF)
    num_tiles = num_m * num_n
    k_steps = tl.cdiv(k, BK)
    in_group = GROUP_M * num_n  # tiles of GROUP_M row blocks share their weight columns in L2
    for tile in tl.range(
        tl.program_id(0), num_tiles, NUM_SMS, flatten=True, warp_specialize=True, num_stages=STAGES
    ):
        first_m = (tile // in_group) * GROUP_M
        group_rows = min(num_m - first_m, GROUP_M)
        off_m = (first_m + (tile % in_group) % group_rows) * BM
        off_n = ((tile % in_group) // group_rows) * HALF
        acc = tl.zeros((BM, 2 * HALF), dtype=tl.float32)
        for step in range(k_steps):
            a = x_desc.load([off_m, step * BK])
            b = w_desc.load([0, off_n, step * BK]).reshape(2 * HALF, BK)
            acc = tl.dot(a, b.T, acc)
        gate, up = tl.split(acc.reshape(BM, 2, HALF).permute(0, 2, 1))
        out = gate / (1.0 + tl.exp(-gate)) * up
        out_desc.store([off_m, off_n], out.to(out_desc.dtype))
