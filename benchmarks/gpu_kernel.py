"""The card's ceilings, and the paged decode kernel's bandwidth beside them (used by gpu_runner).

Ceilings are measured, not quoted: a bf16 matrix product, a device-to-device copy (bytes read +
written), causal SDPA at 8K tokens. The kernel reads K/V of `num_seqs` sequences straight from a
paged cache whose blocks are shuffled; its bandwidth counts each K/V byte once (what it must read).
"""

from __future__ import annotations

import random
from typing import Any

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from kvmesh.workers.model.paged_attention import (
    DECODE_TILE,
    PagedChunk,
    TileShape,
    build_paged_layout,
    paged_attention_reference,
)
from kvmesh.workers.model.paged_attention_kernel import choose_splits, launch_paged_attention


def median_ms(fn: Any) -> float:
    return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))


def measure_ceilings() -> dict[str, float]:
    """bf16 matmul TFLOP/s, HBM copy GB/s, causal SDPA 8K TFLOP/s (GQA 32/8 and plain MHA)."""
    n = 8192
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    matmul_ms = median_ms(lambda: a @ b)
    src = torch.randn(1 << 29, device="cuda", dtype=torch.bfloat16)  # 1 GiB
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src))
    q = torch.randn(1, 32, n, 128, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(1, 8, n, 128, device="cuda", dtype=torch.bfloat16)
    k_full = kv.repeat_interleave(4, dim=1)
    gqa_ms = median_ms(
        lambda: F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
    )
    mha_ms = median_ms(lambda: F.scaled_dot_product_attention(q, k_full, k_full, is_causal=True))
    attn_flops = 4 * 32 * 128 * n * (n + 1) / 2
    return {
        "matmul_bf16_tflops": 2 * n**3 / matmul_ms / 1e9,
        "hbm_copy_gbps": 2 * (1 << 30) / copy_ms / 1e6,
        "sdpa_causal_8k_gqa_tflops": attn_flops / gqa_ms / 1e9,
        "sdpa_causal_8k_mha_tflops": attn_flops / mha_ms / 1e9,
    }


def _decode_case(
    num_seqs: int, seq_len: int, page: int = 16, kv_heads: int = 8, group: int = 4, dim: int = 128
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[PagedChunk]]:
    """Random bf16 queries and a shuffled paged cache holding exactly the sequences' blocks."""
    blocks_per_seq = -(-seq_len // page)
    num_blocks = num_seqs * blocks_per_seq
    shape = (num_blocks, page, kv_heads, dim)
    k = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(num_seqs, kv_heads * group, dim, device="cuda", dtype=torch.bfloat16)
    order = random.Random(0).sample(range(num_blocks), num_blocks)
    chunks = [
        PagedChunk(seq_len, 1, i, order[i * blocks_per_seq : (i + 1) * blocks_per_seq])
        for i in range(num_seqs)
    ]
    return q, k, v, chunks


def bench_decode_kernel(
    num_seqs: int, seq_len: int, tiles: list[TileShape], splits: list[int | None], num_sms: int
) -> list[dict[str, Any]]:
    """Bandwidth of every (tile, split) variant on one shape; the first row is checked against
    the float64 reference."""
    q, k, v, chunks = _decode_case(num_seqs, seq_len)
    kv_bytes = 2 * num_seqs * seq_len * k.shape[2] * k.shape[3] * k.element_size()
    rows: list[dict[str, Any]] = []
    for tile in tiles:
        layout = build_paged_layout(
            chunks, block_size=16, num_queries_per_kv=4, tile=tile, device=torch.device("cuda")
        )
        for num_splits in splits:
            out = torch.full_like(q, float("nan"))

            def run(
                layout: Any = layout, out: torch.Tensor = out, n: int | None = num_splits
            ) -> None:
                launch_paged_attention(q, k, v, out, layout, num_sms=num_sms, num_splits=n)

            ms = median_ms(run)
            used = num_splits or choose_splits(layout, k.shape[2], num_sms)[0]
            row = {
                "num_seqs": num_seqs,
                "seq_len": seq_len,
                "block_n": tile.block_n,
                "num_warps": tile.num_warps,
                "num_stages": tile.num_stages,
                "splits": used,
                "auto_splits": num_splits is None,
                "us": ms * 1e3,
                "gbps": kv_bytes / ms / 1e6,
            }
            if not rows:
                ref = torch.full_like(q, float("nan"))
                paged_attention_reference(q, k, v, ref, layout)
                err = (out.double() - ref.double()).norm() / ref.double().norm()
                row["rel_err_vs_reference"] = err.item()
            rows.append(row)
    return rows


def decode_kernel_report(num_sms: int, sweep: bool = True) -> dict[str, Any]:
    """The goal shape (32 x 2K), with a small sweep unless `sweep` is off, and other shapes at
    the default tile."""
    if not sweep:
        goal = bench_decode_kernel(32, 2048, [DECODE_TILE], [None, 1, 2], num_sms)
        others = bench_decode_kernel(64, 4096, [DECODE_TILE], [None], num_sms)
        others += bench_decode_kernel(1, 2048, [DECODE_TILE], [None], num_sms)
        best = max(goal, key=lambda r: r["gbps"])
        return {
            "goal_shape_default": goal[0],
            "goal_shape_best": best,
            "sweep": goal,
            "others": others,
        }
    sweep_tiles = [
        DECODE_TILE,
        TileShape(32, 32, 4, 3, 256),
        TileShape(16, 128, 4, 3, 256),
        TileShape(16, 64, 4, 2, 256),
        TileShape(16, 64, 4, 4, 256),
        TileShape(16, 64, 8, 3, 256),
        TileShape(16, 128, 8, 3, 256),
    ]
    goal = bench_decode_kernel(32, 2048, sweep_tiles, [None, 1, 2, 4, 8], num_sms)
    others = bench_decode_kernel(64, 4096, [DECODE_TILE], [None], num_sms)
    others += bench_decode_kernel(4, 8192, [DECODE_TILE], [None], num_sms)
    others += bench_decode_kernel(1, 2048, [DECODE_TILE], [None], num_sms)
    default = goal[0]
    best = max(goal, key=lambda r: r["gbps"])
    return {"goal_shape_default": default, "goal_shape_best": best, "sweep": goal, "others": others}


def _prefill_case(
    prefix_len: int, query_len: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int], float]:
    """Random bf16 queries of `query_len` new tokens behind `prefix_len` cached ones in a shuffled
    paged cache (Llama-3-8B heads, 16-token pages): q, k, v, the block order, attention FLOPs."""
    page, kv_heads, group, dim = 16, 8, 4, 128
    total = prefix_len + query_len
    num_blocks = -(-total // page)
    shape = (num_blocks, page, kv_heads, dim)
    k = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(query_len, kv_heads * group, dim, device="cuda", dtype=torch.bfloat16)
    order = random.Random(0).sample(range(num_blocks), num_blocks)
    flops = 4 * kv_heads * group * dim * sum(range(prefix_len + 1, total + 1))
    return q, k, v, order, flops


def cached_prefill_attention_report(
    num_sms: int, prefix_len: int = 7680, query_len: int = 512
) -> dict[str, Any]:
    """Attention of `query_len` new tokens behind a `prefix_len` cached prefix (Llama-3-8B heads,
    bf16, 16-token pages): the paged Triton kernel and the bucketed split the runner uses (its
    time includes gathering the sequence's pages), in TFLOP/s of the attention's FLOPs."""
    from kvmesh.workers.model.paged_attention import PREFILL_TILE
    from kvmesh.workers.model.split_attention import (
        SplitShape,
        cudnn_attention_usable,
        split_prefix_attention,
    )

    page, group = 16, 4
    total = prefix_len + query_len
    q, k, v, order, flops = _prefill_case(prefix_len, query_len)
    table = torch.tensor(order, device="cuda")
    layout = build_paged_layout(
        [PagedChunk(total, query_len, 0, order)],
        block_size=page,
        num_queries_per_kv=group,
        tile=PREFILL_TILE,
        device=torch.device("cuda"),
    )
    out = torch.empty_like(q)
    paged_ms = median_ms(lambda: launch_paged_attention(q, k, v, out, layout, num_sms=num_sms))
    split_out = torch.empty_like(q)
    shape = SplitShape.bucketed(prefix_len, query_len)

    def split() -> torch.Tensor:
        keys = k.index_select(0, table).flatten(0, 1)[:total]
        values = v.index_select(0, table).flatten(0, 1)[:total]
        split_prefix_attention(q, keys, values, shape, split_out)
        return split_out

    def split_pages_only() -> tuple[torch.Tensor, torch.Tensor]:  # what the runner gathers
        return k.index_select(0, table), v.index_select(0, table)

    split_ms = median_ms(split)
    gather_ms = median_ms(split_pages_only)
    ref = torch.full_like(q, float("nan"))
    paged_attention_reference(q, k, v, ref, layout)
    err = (split().double() - ref.double()).norm() / ref.double().norm()
    return {
        **cudnn_pages_report(q, k, v, order, prefix_len, ref, flops),
        "prefix_len": prefix_len,
        "query_len": query_len,
        "cudnn": cudnn_attention_usable(q.device),
        "paged_triton_ms": paged_ms,
        "paged_triton_tflops": flops / paged_ms / 1e9,
        "split_shape": list(shape),
        "split_ms": split_ms,
        "split_tflops": flops / split_ms / 1e9,
        "split_gather_ms": gather_ms,
        "split_rel_err_vs_reference": err.item(),
    }


def cudnn_pages_report(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    order: list[int],
    prefix_len: int,
    ref: torch.Tensor,
    flops: float,
) -> dict[str, Any]:
    """The same attention by cuDNN reading the pages in place (`cudnn_pages`, what the runner
    uses where the frontend's bindings are installed), queries laid out as the runner's; empty
    where it cannot run."""
    from kvmesh.workers.model.cudnn_pages import (
        CacheShape,
        ChunkPages,
        CudnnPages,
        cudnn_pages_usable,
    )

    if not cudnn_pages_usable(q.device):
        return {"cudnn_pages": False}
    num_blocks, page, kv_heads, dim = k.shape
    cache = torch.stack((k, v))
    pages = CudnnPages(
        CacheShape(q.shape[1], kv_heads, dim, num_blocks, page), dtype=q.dtype, device=q.device
    )
    inputs = ChunkPages.of(order, prefix_len, q.shape[0], page, q.device)
    out = torch.empty_like(q)
    # The runner's queries are rows of their own, as its RoPE kernel writes them (read in place).
    q_rows = q.contiguous()
    ms = median_ms(lambda: pages.attend(q_rows, cache, inputs, out))
    err = (out.double() - ref.double()).norm() / ref.double().norm()
    return {
        "cudnn_pages": True,
        "cudnn_pages_ms": ms,
        "cudnn_pages_tflops": flops / ms / 1e9,
        "cudnn_pages_rel_err_vs_reference": err.item(),
        "cudnn_pages_plan_ms": pages.build_ms,
    }


def prefill_tile_sweep(
    num_sms: int, prefix_len: int = 7680, query_len: int = 512
) -> list[dict[str, Any]]:
    """The paged kernel on a chunked prefill (`query_len` new tokens behind `prefix_len` cached,
    Llama-3-8B heads) for a grid of tile shapes and key splits, each checked against the float64
    reference; TFLOP/s of the attention's FLOPs, fastest first."""
    page, group = 16, 4
    q, k, v, order, flops = _prefill_case(prefix_len, query_len)
    chunks = [PagedChunk(prefix_len + query_len, query_len, 0, order)]
    ref: torch.Tensor | None = None
    rows: list[dict[str, Any]] = []
    for block_m in (64, 128):
        for block_n in (32, 64, 128):
            for warps in (4, 8):
                for stages in (2, 3, 4):
                    tile = TileShape(block_m, block_n, warps, stages, 1024)
                    layout = build_paged_layout(
                        chunks, block_size=page, num_queries_per_kv=group, tile=tile,
                        device=torch.device("cuda"),
                    )  # fmt: skip
                    if ref is None:
                        ref = torch.full_like(q, float("nan"))
                        paged_attention_reference(q, k, v, ref, layout)
                    for splits in (1, 2, 4):
                        out = torch.full_like(q, float("nan"))

                        def run(
                            layout: Any = layout, out: torch.Tensor = out, n: int = splits
                        ) -> None:
                            launch_paged_attention(q, k, v, out, layout, num_sms=num_sms,
                                                   num_splits=n)  # fmt: skip

                        try:
                            ms = median_ms(run)
                        except Exception as exc:  # a tile the compiler cannot fit (shared memory)
                            rows.append({"tile": [block_m, block_n, warps, stages],
                                         "splits": splits, "error": str(exc)[:80]})  # fmt: skip
                            continue
                        err = (out.double() - ref.double()).norm() / ref.double().norm()
                        rows.append({
                            "tile": [block_m, block_n, warps, stages], "splits": splits,
                            "us": ms * 1e3, "tflops": flops / ms / 1e9,
                            "rel_err_vs_reference": err.item(),
                        })  # fmt: skip
    return sorted(rows, key=lambda r: -r.get("tflops", 0.0))


if __name__ == "__main__":
    import json
    import sys

    props = torch.cuda.get_device_properties(0)
    result = {
        "device": props.name,
        "prefill_tile_sweep": prefill_tile_sweep(props.multi_processor_count),
    }
    for row in result["prefill_tile_sweep"][:12]:
        print(json.dumps(row), flush=True)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(result, f, indent=2)
