"""cuDNN reading the paged cache in place (`cudnn_pages`): the same attention as a float64
softmax over the gathered sequence, at lengths below its bucket's bounds, with the rows around
the chunk untouched; and the runner's logits unchanged by it."""

from __future__ import annotations

import random

import pytest
import torch

from kvmesh.workers.model.cudnn_pages import CacheShape, ChunkPages, CudnnPages, cudnn_pages_usable

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or not cudnn_pages_usable(torch.device("cuda")),
        reason="needs CUDA, a Hopper card and the cuDNN frontend's bindings",
    ),
]

TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.mark.parametrize(
    ("dtype", "runs"), [(torch.bfloat16, False), (torch.float16, False), (torch.bfloat16, True)]
)
def test_paged_attention_matches_float64_reference(dtype: torch.dtype, runs: bool) -> None:
    """Blocks scattered over the pool (one a page), or in runs of four starting anywhere (one
    ending at the pool's last block) read as 64-token pages that overlap."""
    heads, kv_heads, dim, block, num_blocks = 32, 8, 128, 16, 1202
    shape = CacheShape(heads, kv_heads, dim, num_blocks, block)
    pages = CudnnPages(shape, dtype=dtype, device=torch.device("cuda"))
    gen = torch.Generator(device="cuda").manual_seed(7)
    cache = torch.randn((2, num_blocks, block, kv_heads, dim), device="cuda", generator=gen)
    cache = cache.to(dtype)
    rng = random.Random(7)
    # (cached, new): one bucket's bounds exactly, and lengths well inside the same bucket
    for prefix, new in ((7680, 512), (7001, 300), (2049, 513), (40, 9)):
        total = prefix + new
        used = -(-total // block)
        if runs:  # the last run partly used by the 7001 + 300 and 40 + 9 chunks
            starts = [num_blocks - 4] + rng.sample(range(3, num_blocks - 9, 5), -(-used // 4) - 1)
            table = [s + i for s in starts for i in range(4)][:used]
        else:
            table = rng.sample(range(num_blocks), used)
        inputs = ChunkPages.of(
            table, prefix, new, block, torch.device("cuda"), num_blocks=num_blocks
        )
        assert inputs.bucket.page_blocks == (4 if runs else 1)
        q = torch.randn((new, heads, dim), device="cuda", generator=gen).to(dtype)
        rows = torch.full((new + 6, heads, dim), float("nan"), device="cuda", dtype=dtype)
        got = rows[3 : 3 + new]
        pages.attend(q, cache, inputs, got)
        ids = torch.tensor(table, device="cuda")
        keys, values = (
            cache[i].index_select(0, ids).flatten(0, 1)[:total].double()
            .repeat_interleave(heads // kv_heads, dim=1)
            for i in (0, 1)
        )  # fmt: skip
        scores = torch.einsum("qhd,khd->hqk", q.double(), keys) / dim**0.5
        query_pos = torch.arange(prefix, total, device="cuda")
        hidden = torch.arange(total, device="cuda")[None, :] > query_pos[:, None]
        want = torch.einsum(
            "hqk,khd->qhd", scores.masked_fill(hidden, float("-inf")).softmax(-1), values
        )
        assert rows[:3].isnan().all() and rows[3 + new :].isnan().all()
        error = (got.double() - want).norm() / want.norm()
        assert error.item() < TOLERANCE[dtype], (prefix, new, error.item())
    # two of the four shared a bucket: one plan served both
    assert len(pages.buckets) == 3
    pages.check_invariants()
