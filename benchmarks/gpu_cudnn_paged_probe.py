"""Probe: cuDNN's fused attention reading the paged KV cache in place (issue 18).

The split prefill (`split_attention`) gathers a chunk's cached blocks into contiguous K/V before
cuDNN runs, ~15 % of the cached-prefix attention's GPU time. cuDNN (9.5 and newer) can read
paged caches itself through a page table, with the true lengths as device tensors and a
bottom-right causal mask, so one call could replace gathers + two attention calls + merge. This
probe measures it at the 8B shape (32 query heads over 8 KV heads, head dim 128, 16-token
blocks scattered in the pool) against the split path, and checks it against the split's output
at lengths smaller than the plan's bounds (one plan per bound, lengths as data).

Needs the `nvidia-cudnn-frontend` wheel (Python bindings of the cuDNN graph API).

Usage (GPU machine): python benchmarks/gpu_cudnn_paged_probe.py [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import torch
from gpu_split_probe import event_ms  # type: ignore[import-not-found]

from kvmesh.workers.model.split_attention import SplitShape, split_prefix_attention

HEADS, KV_HEADS, DIM, BLOCK = 32, 8, 128, 16
NUM_BLOCKS = 2048


def wall_us(fn: Any, reps: int = 30) -> float:
    """Host time to issue one call (the GPU drained before and after)."""
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
        torch.cuda.synchronize()
    return sorted(samples)[reps // 2] * 1e6


def flops(prefix: int, new: int) -> float:
    return 4.0 * HEADS * DIM * new * (prefix + (new + 1) / 2)


class PagedGraph:
    """One cuDNN graph: attention of up to `max_new` query rows over up to `max_pages` blocks."""

    def __init__(self, cudnn: Any, handle: Any, max_new: int, max_pages: int) -> None:
        self.cudnn, self.handle = cudnn, handle
        dt = cudnn.data_type
        g = cudnn.pygraph(
            io_data_type=dt.BFLOAT16,
            intermediate_data_type=dt.FLOAT,
            compute_data_type=dt.FLOAT,
            handle=handle,
        )
        row = HEADS * DIM
        self.q = g.tensor(
            name="q", dim=[1, HEADS, max_new, DIM], stride=[max_new * row, DIM, row, 1],
            data_type=dt.BFLOAT16,
        )  # fmt: skip
        page = BLOCK * KV_HEADS * DIM
        kv_dims, kv_strides = [NUM_BLOCKS, KV_HEADS, BLOCK, DIM], [page, DIM, KV_HEADS * DIM, 1]
        self.k = g.tensor(name="k", dim=kv_dims, stride=kv_strides, data_type=dt.BFLOAT16)
        self.v = g.tensor(name="v", dim=kv_dims, stride=kv_strides, data_type=dt.BFLOAT16)
        table = dict(dim=[1, 1, max_pages, 1], stride=[max_pages, max_pages, 1, 1])
        self.table_k = g.tensor(name="table_k", data_type=dt.INT32, **table)
        self.table_v = g.tensor(name="table_v", data_type=dt.INT32, **table)
        lens = dict(dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=dt.INT32)
        self.len_q = g.tensor(name="len_q", **lens)
        self.len_kv = g.tensor(name="len_kv", **lens)
        self.o, _ = g.sdpa(
            name="sdpa", q=self.q, k=self.k, v=self.v, generate_stats=False,
            attn_scale=1.0 / math.sqrt(DIM), use_padding_mask=True,
            seq_len_q=self.len_q, seq_len_kv=self.len_kv,
            diagonal_alignment=cudnn.diagonal_alignment.BOTTOM_RIGHT,
            diagonal_band_right_bound=0,
            paged_attention_k_table=self.table_k, paged_attention_v_table=self.table_v,
            paged_attention_max_seq_len_kv=max_pages * BLOCK,
        )  # fmt: skip
        self.o.set_output(True).set_dim([1, HEADS, max_new, DIM]).set_stride(
            [max_new * row, DIM, row, 1]
        )
        began = time.perf_counter()
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.B, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans(cudnn.build_plan_policy.ALL)
        self.build_ms = (time.perf_counter() - began) * 1e3
        self.graph = g
        self.max_new, self.max_pages = max_new, max_pages
        self.num_plans = g.get_execution_plan_count()
        sizes = [g.get_workspace_size_plan_at_index(i) for i in range(self.num_plans)]
        self.workspace = torch.empty(max(1, *sizes), device="cuda", dtype=torch.uint8)
        self.plan_index: int | None = None

    def run(
        self,
        q: torch.Tensor,
        cache: torch.Tensor,
        table: torch.Tensor,
        len_q: torch.Tensor,
        len_kv: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """q / out [max_new, heads, dim] (rows past len_q ignored); cache [2, blocks, block,
        kv_heads, dim]; table int32 [max_pages]; lengths int32 [1]."""
        pack = {
                self.q: q, self.k: cache[0], self.v: cache[1], self.table_k: table,
                self.table_v: table, self.len_q: len_q, self.len_kv: len_kv, self.o: out,
        }  # fmt: skip
        if self.plan_index is None:
            self.graph.execute(pack, self.workspace, handle=self.handle)
        else:
            self.graph.execute_plan_at_index(
                pack, self.workspace, self.plan_index, handle=self.handle
            )


def measure_case(
    graph: PagedGraph, cache: torch.Tensor, gen: torch.Generator, prefix: int, new: int
) -> dict[str, Any]:
    """One (prefix, new) case: cuDNN reading the pages vs the split path, timed and checked."""
    max_new, max_pages = graph.max_new, graph.max_pages
    total = prefix + new
    pages = -(-total // BLOCK)
    ids = torch.randperm(NUM_BLOCKS, device="cuda")[:pages].to(torch.int32)
    table = torch.zeros(max_pages, dtype=torch.int32, device="cuda")
    table[:pages] = ids
    q = torch.randn((max_new, HEADS, DIM), device="cuda", dtype=torch.bfloat16, generator=gen)
    len_q = torch.tensor([new], dtype=torch.int32, device="cuda")
    len_kv = torch.tensor([total], dtype=torch.int32, device="cuda")
    out = torch.zeros_like(q)
    graph.run(q, cache, table, len_q, len_kv, out)
    # The split path as the runner runs it: gather the blocks, then split + merge.
    ref = torch.empty((new, HEADS, DIM), device="cuda", dtype=torch.bfloat16)
    ids64 = ids.long()
    shape = SplitShape.bucketed(prefix, new)

    def split_path() -> None:
        keys = cache[0].index_select(0, ids64).view(-1, KV_HEADS, DIM)[:total]
        values = cache[1].index_select(0, ids64).view(-1, KV_HEADS, DIM)[:total]
        split_prefix_attention(q[:new], keys, values, shape, ref)

    split_path()
    torch.cuda.synchronize()
    err = (out[:new].float() - ref.float()).abs().max().item()
    keys = cache[0].index_select(0, ids64).view(-1, KV_HEADS, DIM)[:total].float()
    values = cache[1].index_select(0, ids64).view(-1, KV_HEADS, DIM)[:total].float()
    group = HEADS // KV_HEADS
    kk = keys.repeat_interleave(group, 1).transpose(0, 1)
    vv = values.repeat_interleave(group, 1).transpose(0, 1)
    scores = q[:new].float().transpose(0, 1) @ kk.transpose(-1, -2) / math.sqrt(DIM)
    hidden = torch.ones(new, total, dtype=torch.bool, device="cuda").triu(total - new + 1)
    exact = torch.softmax(scores.masked_fill(hidden, -math.inf), -1) @ vv
    err_exact = (out[:new].float() - exact.transpose(0, 1)).abs().max().item()
    err_split = (ref.float() - exact.transpose(0, 1)).abs().max().item()
    paged_ms = event_ms(lambda: graph.run(q, cache, table, len_q, len_kv, out))
    per_plan_us = []
    for index in range(graph.num_plans):
        graph.plan_index = index
        try:
            per_plan_us.append(
                event_ms(lambda: graph.run(q, cache, table, len_q, len_kv, out)) * 1e3
            )
        except Exception as exc:  # noqa: BLE001 - a plan that will not run here
            per_plan_us.append(float("nan"))
            print(f"plan {index}: {exc}")
    graph.plan_index = None
    split_ms = event_ms(split_path)
    row = {
        "prefix": prefix,
        "new": new,
        "cudnn_paged_us": paged_ms * 1e3,
        "cudnn_paged_tflops": flops(prefix, new) / paged_ms / 1e9,
        "split_with_gathers_us": split_ms * 1e3,
        "split_with_gathers_tflops": flops(prefix, new) / split_ms / 1e9,
        "cudnn_paged_issue_us": wall_us(lambda: graph.run(q, cache, table, len_q, len_kv, out)),
        "split_issue_us": wall_us(split_path),
        "max_err_vs_split": err,
        "per_plan_us": per_plan_us,
        "per_plan_tflops": [flops(prefix, new) / us / 1e6 for us in per_plan_us],
        "max_err_cudnn_vs_fp32": err_exact,
        "max_err_split_vs_fp32": err_split,
    }
    print(
        f"prefix {prefix} new {new}: cuDNN paged {row['cudnn_paged_us']:.0f} us = "
        f"{row['cudnn_paged_tflops']:.0f} TFLOP/s | split with gathers "
        f"{row['split_with_gathers_us']:.0f} us = {row['split_with_gathers_tflops']:.0f} | "
        f"issue {row['cudnn_paged_issue_us']:.0f} vs {row['split_issue_us']:.0f} us | "
        f"err vs split {err:.2e}, vs fp32 {err_exact:.2e} (split {err_split:.2e}); "
        f"every plan (us): {', '.join(f'{us:.0f}' for us in per_plan_us)}"
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    import cudnn

    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "cudnn_backend": cudnn.backend_version(),
        "torch": torch.__version__,
    }
    print(result)
    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    gen = torch.Generator(device="cuda").manual_seed(0)
    cache = torch.randn(
        (2, NUM_BLOCKS, BLOCK, KV_HEADS, DIM), device="cuda", dtype=torch.bfloat16, generator=gen
    )
    max_new, max_pages = 512, 512
    began = time.perf_counter()
    graph = PagedGraph(cudnn, handle, max_new, max_pages)
    result["plan_build_ms"] = (time.perf_counter() - began) * 1e3
    print(f"plan built in {result['plan_build_ms']:.0f} ms")
    rows = [
        measure_case(graph, cache, gen, prefix, new)
        for prefix, new in ((7680, 512), (7000, 300), (4096, 512), (2100, 64))
    ]
    result["rows"] = rows
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
