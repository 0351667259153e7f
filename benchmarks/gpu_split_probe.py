"""Probes behind the split prefill attention's figures (docs/benchmarks.md, issue 18), one GPU.

  1. cuDNN's unmasked prefix part alone: 512 new tokens (32 heads folded into 8 KV groups) over
     a 7,680-token prefix, in TFLOP/s, beside flash attention on the same part
  2. the whole split (`split_prefix_attention`) under the torch profiler: GPU time per call by
     kernel, and the host time that launches it
  3. cuDNN's plan per shape: wall time of the split on a shape seen before vs on new
     (prefix, chunk) lengths

Usage (GPU machine): python benchmarks/gpu_split_probe.py
"""

from __future__ import annotations

import random
import time

import torch
from torch.profiler import ProfilerActivity, profile

from kvmesh.workers.model.split_attention import SplitShape, split_prefix_attention

HEADS, KV_HEADS, DIM = 32, 8, 128
NEW, TOTAL = 512, 8192
PREFIX = TOTAL - NEW


def event_ms(fn: object, reps: int = 20) -> float:
    for _ in range(3):
        fn()  # type: ignore[operator]
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()  # type: ignore[operator]
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def prefix_part() -> None:
    q = torch.randn(1, HEADS, NEW, DIM, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, KV_HEADS, PREFIX, DIM, device="cuda", dtype=torch.bfloat16)
    folded = q.view(1, KV_HEADS, -1, DIM)
    flops = 4 * HEADS * DIM * NEW * PREFIX
    ops = torch.ops.aten
    for name, fn in (
        ("cudnn", lambda: ops._scaled_dot_product_cudnn_attention(folded, k, k, None, True)),
        ("flash", lambda: ops._scaled_dot_product_flash_attention(folded, k, k)),
    ):
        ms = event_ms(fn)
        print(f"prefix part, {name}: {ms * 1e3:.0f} us = {flops / ms / 1e9:.0f} TFLOP/s")


def split_profile() -> None:
    q = torch.randn(NEW, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(TOTAL, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)

    def split() -> None:
        split_prefix_attention(q, k, k, SplitShape.exact(PREFIX, NEW), out)

    for _ in range(5):
        split()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            split()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12))


def plan_per_shape() -> None:
    k = torch.randn(9000, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16)

    def call_ms(prefix: int, new: int) -> float:
        q = torch.randn(new, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(q)
        torch.cuda.synchronize()
        start = time.perf_counter()
        end = prefix + new
        split_prefix_attention(q, k[:end], k[:end], SplitShape.exact(prefix, new), out)
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3

    call_ms(PREFIX, NEW)
    print("same shape again (ms)", [round(call_ms(PREFIX, NEW), 2) for _ in range(3)])
    rng = random.Random(0)
    new_shapes = [(rng.randrange(1000, 8000), rng.randrange(2, 600)) for _ in range(8)]
    print("new shapes (ms)", [round(call_ms(p, n), 2) for p, n in new_shapes])


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), "cuDNN", torch.backends.cudnn.version())
    prefix_part()
    split_profile()
    plan_per_shape()
