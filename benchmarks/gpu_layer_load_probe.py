"""Probe: the host tier's layer-by-layer load, how many programs and how deep a step (issue 10).

A host hit's prefill overlaps the PCIe load of its 7.5K-token prefix (1 GB for the 8B shape)
layer by layer (`workers/kv/layer_load.py`): a Triton kernel of a few persistent programs reads
the pinned host slots in place. The load alone has measured 24.8-31.2 ms (32-40 GB/s) where a
pinned copy reaches ~48 GB/s, and beside the prefill it holds SMs the prefill's matmuls want.
This probe times the kernel per (programs, elements a step, warps): alone, and beside a stream of
bf16 matmuls of the prefill's shape (512 tokens x the 8B model's projections), against the
matmuls alone. Then `LayerLoad` itself, the kernel against the copy engine (strided DMA per run
of consecutive host slots, then a scatter), with the slots in 1 run, in 8 runs and scattered:
alone, and layered as a forward is (layer l's matmuls wait for layer l's event).

Usage (GPU machine): python benchmarks/gpu_layer_load_probe.py [--json FILE] [--skip-settings]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

import torch

from kvmesh.workers.kv import layer_load
from kvmesh.workers.kv.copy_engine import CopyEngine
from kvmesh.workers.kv.layer_load import LayerLoad

LAYERS, BLOCK, KV_HEADS, DIM = 32, 16, 8, 128
NUM_BLOCKS, NUM_SLOTS, PAIRS = 1024, 1024, 480
SETTINGS = [
    (programs, chunk, warps)
    for programs in (16, 32, 64, 132)
    for chunk in (4096, 16384)
    for warps in (4, 8)
]


def timed_ms(fn: Any, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end))
    return sorted(samples)[reps // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--skip-settings", action="store_true", help="only LayerLoad's two ways")
    args = parser.parse_args()
    host = torch.randn(
        (NUM_SLOTS, LAYERS, 2, BLOCK, KV_HEADS, DIM), dtype=torch.bfloat16
    ).pin_memory()
    cache = torch.zeros(
        (LAYERS, 2, NUM_BLOCKS, BLOCK, KV_HEADS, DIM), device="cuda", dtype=torch.bfloat16
    )
    rng = random.Random(0)
    slots = torch.tensor(rng.sample(range(NUM_SLOTS), PAIRS), dtype=torch.int32, device="cuda")
    blocks = torch.tensor(rng.sample(range(NUM_BLOCKS), PAIRS), dtype=torch.int32, device="cuda")
    slab = BLOCK * KV_HEADS * DIM
    moved = PAIRS * LAYERS * 2 * slab * 2  # bytes
    side = torch.cuda.Stream()
    x = torch.randn((512, 4096), device="cuda", dtype=torch.bfloat16)
    weights = [
        torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        for shape in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))
    ]
    acts = torch.randn((512, 14336), device="cuda", dtype=torch.bfloat16)

    def matmuls() -> None:  # one layer's projections at 512 tokens, for every layer
        for _ in range(LAYERS):
            for w in weights:
                (acts if w.shape[1] == 14336 else x) @ w.t()

    host_pcie = torch.empty(moved // 2, dtype=torch.bfloat16).pin_memory()
    dev = torch.empty(moved // 2, device="cuda", dtype=torch.bfloat16)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "bytes": moved,
        "pinned_copy_GBps": moved / timed_ms(lambda: dev.copy_(host_pcie, non_blocking=True)) / 1e6,
        "matmuls_ms": timed_ms(matmuls),
        "rows": [],
    }
    print(
        f"1 GB pinned copy {result['pinned_copy_GBps']:.1f} GB/s; "
        f"matmuls alone {result['matmuls_ms']:.2f} ms"
    )
    for programs, chunk, warps in [] if args.skip_settings else SETTINGS:

        def enqueue(programs: int = programs, chunk: int = chunk, warps: int = warps) -> None:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for layer in range(LAYERS):
                    layer_load._load_layer_kernel[(programs,)](
                        host, cache, slots, blocks, layer, LAYERS, NUM_BLOCKS, PAIRS, slab,
                        CHUNK=chunk, NUM_PROGRAMS=programs, num_warps=warps,
                    )  # fmt: skip

        def load(enqueue: Any = enqueue) -> None:
            enqueue()
            torch.cuda.current_stream().wait_stream(side)

        def both(enqueue: Any = enqueue) -> None:
            enqueue()
            matmuls()
            torch.cuda.current_stream().wait_stream(side)

        alone = timed_ms(load)
        together = timed_ms(both)
        row = {
            "programs": programs,
            "chunk": chunk,
            "warps": warps,
            "load_ms": alone,
            "load_GBps": moved / alone / 1e6,
            "with_matmuls_ms": together,
            "over_max": together / max(alone, result["matmuls_ms"]),
        }
        result["rows"].append(row)
        print(
            f"programs {programs:3d} chunk {chunk:5d} warps {warps}: load {alone:6.2f} ms "
            f"= {row['load_GBps']:5.1f} GB/s; beside the matmuls {together:6.2f} ms "
            f"({row['over_max']:.2f}x the longer alone)"
        )
    result["ways"] = ways(host, cache, weights, x, acts, moved, result["matmuls_ms"], rng)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


def ways(
    host: torch.Tensor,
    cache: torch.Tensor,
    weights: list[torch.Tensor],
    x: torch.Tensor,
    acts: torch.Tensor,
    moved: int,
    matmuls_ms: float,
    rng: random.Random,
) -> list[dict[str, Any]]:
    """`LayerLoad` by the kernel and by the copy engine, alone and layered beside the matmuls."""
    engine = CopyEngine.find()
    print(f"copy engine: {'found' if engine else 'none (no runtime library mapped)'}")
    per_run = PAIRS // 8
    layouts = {
        "1 run": list(range(100, 100 + PAIRS)),
        "8 runs": [s for r in range(8) for s in range(r * 120, r * 120 + per_run)],
        "scattered": rng.sample(range(NUM_SLOTS), PAIRS),
    }
    blocks = rng.sample(range(NUM_BLOCKS), PAIRS)
    dma = torch.cuda.Stream(priority=-1)
    rows = []
    kept: list[LayerLoad] = []  # loads whose work may still run (timed_ms synchronises)
    for layout, slots in layouts.items():
        for way in ("kernel", "copy engine"):
            if way == "copy engine" and engine is None:
                continue

            def start(slots: list[int] = slots, way: str = way) -> LayerLoad:
                use = engine if way == "copy engine" else None
                return LayerLoad(host, slots, cache, blocks, dma, copy_engine=use)

            def alone(start: Any = start) -> None:
                load = start()
                kept.append(load)  # it owns its staging until its work is done
                torch.cuda.current_stream().wait_event(load.done)

            def layered(start: Any = start) -> None:
                load = start()
                for layer in range(LAYERS):
                    load.wait_layer(layer)
                    for w in weights:
                        (acts if w.shape[1] == 14336 else x) @ w.t()
                kept.append(load)

            first = start()
            used = first.uses_copy_engine
            torch.cuda.synchronize()
            del first
            row = {"slots": layout, "way": way, "copy_engine_used": used}
            row["load_ms"] = timed_ms(alone)
            row["load_GBps"] = moved / row["load_ms"] / 1e6
            row["layered_ms"] = timed_ms(layered)
            row["over_matmuls"] = row["layered_ms"] / matmuls_ms
            kept.clear()
            rows.append(row)
            fell_back = " (kernel: too many runs)" if way != "kernel" and not used else ""
            print(
                f"{layout:>9} {way:>11}{fell_back}: load "
                f"{row['load_ms']:6.2f} ms = {row['load_GBps']:5.1f} GB/s; layered beside the "
                f"matmuls {row['layered_ms']:6.2f} ms ({row['over_matmuls']:.2f}x the matmuls)"
            )
    return rows


if __name__ == "__main__":
    main()
