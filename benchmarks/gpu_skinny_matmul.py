"""A decode step's projections: the few-row Triton matmuls (`skinny_matmul`) against cuBLAS.

What the runner ran for a batch of 32 rows (add + RMSNorm, cuBLAS's `F.linear`, SiLU x up, the
elementwise kernels each a kernel of its own) against the few-row kernels that fold the norm and
the SiLU into the product, on Llama-3-8B's shapes:

  * a step's projections: 32 layers' weights (13.96 GB) and their norms through one CUDA graph;
  * each projection with every tile of a sweep, its weight read rate beside the card's
    device-to-device copy rate, its error against float64 beside the unfused kernels';
  * the default tiles (`tile_for`) at 1-64 rows.

Each timing replays a CUDA graph of calls that cycle through enough copies of the weight to
overflow L2, as a decode step meets each weight cold.

    python3 benchmarks/gpu_skinny_matmul.py --out OUT   # table; OUT/skinny_matmul.json
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kvmesh.workers.model.elementwise_kernels import add_rms_norm, silu_mul
from kvmesh.workers.model.skinny_matmul import (
    MatmulTile,
    add_matmul,
    norm_input,
    norm_matmul,
    skinny_matmul,
    tile_for,
)

SHAPES = {  # name: (N, K) of Llama-3-8B's weights, and what runs before and after the product
    "qkv": (6144, 4096, "norm"),
    "o": (4096, 4096, "add+norm"),
    "gate_up": (28672, 4096, "norm+silu"),
    "down": (4096, 14336, "add+norm"),
    "lm_head": (128256, 4096, "plain"),
}
L2_OVERFLOW_BYTES = 320 << 20
EPS = 1e-5


def graph_us(calls: list[Callable[[], object]], replays: int = 5) -> float:
    """Median time per call of a CUDA graph that makes `calls` in order."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls[:2]:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / len(calls))
    samples.sort()
    return samples[len(samples) // 2]


def copy_gbps() -> float:
    src = torch.empty(1 << 29, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    us = graph_us([lambda: dst.copy_(src)] * 10)
    return 2 * src.numel() * 2 / us / 1e3


class Case:
    """One projection's inputs at `rows` rows, with copies of its weight enough to overflow L2.

    Kinds, unfused (what the runner ran before) against fused:
      plain      F.linear                                  skinny_matmul
      norm       F.linear of the normed input              norm_matmul
      norm+silu  silu_mul(F.linear of the normed input)    norm_matmul(silu=True)
      add+norm   add_rms_norm(residual, F.linear)          add_matmul
    """

    def __init__(self, name: str, rows: int) -> None:
        n, k, self.kind = SHAPES[name]
        copies = max(2, -(-L2_OVERFLOW_BYTES // (n * k * 2)))
        self.ws = [
            torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)
        ]
        self.x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        out_size = n // 2 if self.kind == "norm+silu" else n
        self.residual = torch.randn(rows, out_size, device="cuda", dtype=torch.bfloat16)
        self.g = 1 + 0.1 * torch.randn(max(n, k), device="cuda", dtype=torch.bfloat16)
        self.h = F.rms_norm(self.x, (k,), self.g[:k], EPS)
        self.normed = norm_input(self.x, self.g[:k])
        self.weight_bytes = n * k * 2

    def unfused(self, w: torch.Tensor) -> torch.Tensor:
        if self.kind == "plain":
            return F.linear(self.x, w)
        if self.kind == "add+norm":
            return add_rms_norm(self.residual, F.linear(self.x, w), self.g[: w.shape[0]], EPS)[0]
        out = F.linear(self.h, w)
        return silu_mul(out) if self.kind == "norm+silu" else out

    def fused(self, w: torch.Tensor, tile: MatmulTile | None = None) -> torch.Tensor:
        if self.kind == "plain":
            return skinny_matmul(self.x, w, tile)
        if self.kind == "add+norm":
            return add_matmul(self.x, w, self.residual, self.g[: w.shape[0]], tile)[0]
        return norm_matmul(self.normed, EPS, w, silu=self.kind == "norm+silu", tile=tile)

    def time_us(self, fn: Callable[[torch.Tensor], object]) -> float:
        reps = max(8, len(self.ws))
        copies = len(self.ws)
        return graph_us([lambda w=self.ws[i % copies]: fn(w) for i in range(reps)])

    def error(self, tile: MatmulTile | None) -> float:
        """Largest |difference| from the float64 result over its largest |value|; the unfused
        kernels' when tile is None."""
        w = self.ws[0].double()
        x = self.x.double()
        if self.kind in ("norm", "norm+silu"):
            g = self.g[: x.shape[1]].double()
            x = x / (x.pow(2).mean(-1, keepdim=True) + EPS).sqrt() * g
        want = x @ w.T
        if self.kind == "norm+silu":
            half = want.shape[1] // 2
            want = F.silu(want[:, :half]) * want[:, half:]
        if self.kind == "add+norm":
            want = want + self.residual.double()
        got = self.unfused(self.ws[0]) if tile is None else self.fused(self.ws[0], tile)
        return float((got.double() - want).abs().max() / want.abs().max())


def sweep_tiles(kind: str) -> list[MatmulTile]:
    tiles = []
    weight_tiles = 2 if kind == "norm+silu" else 1
    for bn, bk, warps, stages in itertools.product(
        (16, 32, 64, 128), (128, 256, 512), (4, 8), (3, 4, 6)
    ):
        if (32 + weight_tiles * bn) * bk * 2 * stages > 160 << 10:  # past the shared memory
            continue
        tiles.append(MatmulTile(bn, bk, warps, stages))
    return tiles


def sweep(rows: int, budget_s: float) -> dict[str, Any]:
    results: dict[str, Any] = {}
    began = time.perf_counter()
    for name in SHAPES:
        case = Case(name, rows)
        n, k, kind = SHAPES[name]
        unfused = case.time_us(case.unfused)
        default = tile_for(n, k, kind == "norm+silu")
        row: dict[str, Any] = {
            "n": n,
            "k": k,
            "kind": kind,
            "weight_mb": case.weight_bytes / 1e6,
            "unfused_us": unfused,
            "unfused_gbps": case.weight_bytes / unfused / 1e3,
            "unfused_error": case.error(None),
            "default_tile": dataclasses.asdict(default) if default else None,
            "default_us": case.time_us(case.fused),
            "tiles": [],
        }
        for tile in sweep_tiles(kind):
            if k % tile.block_k or time.perf_counter() - began > budget_s:
                continue
            try:
                us = case.time_us(lambda w, t=tile, c=case: c.fused(w, t))
                error = case.error(tile)
            except Exception as exc:  # a tile the card cannot hold (shared memory, registers)
                row["tiles"].append({"tile": dataclasses.asdict(tile), "failed": str(exc)[:120]})
                continue
            row["tiles"].append(
                {
                    "tile": dataclasses.asdict(tile),
                    "us": us,
                    "gbps": case.weight_bytes / us / 1e3,
                    "error": error,
                }
            )
        ok = sorted((t for t in row["tiles"] if "us" in t), key=lambda t: t["us"])
        row["best"] = ok[0] if ok else None
        results[name] = row
        print(
            f"{name:8s} ({kind}) unfused {unfused:7.1f} us {row['unfused_gbps']:6.0f} GB/s"
            f" err {row['unfused_error']:.1e} | default tile {row['default_us']:7.1f} us",
            flush=True,
        )
        for t in ok[:4]:
            print(f"   {t['us']:7.1f} us {t['gbps']:6.0f} GB/s err {t['error']:.1e} {t['tile']}")
        del case
        torch.cuda.empty_cache()
    return results


def rows_table() -> dict[str, Any]:
    """The default tiles at 1-64 rows against the unfused kernels."""
    out: dict[str, Any] = {}
    for name in SHAPES:
        out[name] = {}
        for rows in (1, 4, 8, 16, 32, 48, 64):
            case = Case(name, rows)
            unfused, fused = case.time_us(case.unfused), case.time_us(case.fused)
            out[name][rows] = {"unfused_us": unfused, "fused_us": fused}
            print(f"{name:8s} rows {rows:3d}: unfused {unfused:7.1f} us, fused {fused:7.1f}")
            del case
        torch.cuda.empty_cache()
    return out


def step_projections(rows: int = 32) -> dict[str, float]:
    """A decode step's 32 layers of projections, norms and SiLU x up in one graph (attention
    and RoPE left out): the unfused kernels (two add + RMSNorm, four cuBLAS products, SiLU x up
    a layer) against the fused ones (four)."""
    layer_names = ("qkv", "o", "gate_up", "down")
    layers = [
        {
            name: torch.randn(*SHAPES[name][:2], device="cuda", dtype=torch.bfloat16)
            for name in layer_names
        }
        for _ in range(32)
    ]
    hidden = SHAPES["o"][1]
    x, attended = (torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16) for _ in "ab")
    g = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)
    normed = norm_input(x, g)

    def unfused(layer: dict[str, torch.Tensor]) -> None:
        _, h = add_rms_norm(x, attended, g, EPS)
        F.linear(h, layer["qkv"])
        o = F.linear(attended, layer["o"])
        _, h = add_rms_norm(x, o, g, EPS)
        F.linear(silu_mul(F.linear(h, layer["gate_up"])), layer["down"])

    def fused(layer: dict[str, torch.Tensor]) -> None:
        norm_matmul(normed, EPS, layer["qkv"])
        _, after_o = add_matmul(attended, layer["o"], x, g)
        act = norm_matmul(after_o, EPS, layer["gate_up"], silu=True)
        add_matmul(act, layer["down"], x, g)

    result = {}
    for label, fn in (("unfused", unfused), ("fused", fused)):
        calls = [lambda layer=layer, fn=fn: fn(layer) for layer in layers]
        result[f"{label}_ms"] = graph_us(calls) * len(calls) / 1e3
    weight_bytes = sum(w.numel() * 2 for layer in layers for w in layer.values())
    result["weight_gb"] = weight_bytes / 1e9
    for label in ("unfused", "fused"):
        result[f"{label}_gbps"] = weight_bytes / result[f"{label}_ms"] / 1e6
    print(
        f"step projections (32 layers, {rows} rows): unfused {result['unfused_ms']:.3f} ms"
        f" ({result['unfused_gbps']:.0f} GB/s), fused {result['fused_ms']:.3f} ms"
        f" ({result['fused_gbps']:.0f} GB/s)",
        flush=True,
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--budget-s", type=float, default=300.0, help="stop the sweep after this")
    args = parser.parse_args()
    torch.manual_seed(0)
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "copy_gbps": copy_gbps()}
    print(f"{report['device']}: device-to-device copy {report['copy_gbps']:.0f} GB/s", flush=True)
    report["step_projections"] = step_projections()
    report["sweep_rows_32"] = sweep(32, args.budget_s)
    report["rows"] = rows_table()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "skinny_matmul.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
