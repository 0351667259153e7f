"""Paged attention on CUDA: the Triton kernel computes what the float64 reference computes, on
fresh random inputs, writes exactly the layout's rows, and the runner's paths agree."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from kvmesh.workers.model import batch_plan
from kvmesh.workers.model.batch_plan import AttentionMode
from kvmesh.workers.model.cudnn_pages import cudnn_pages_usable
from kvmesh.workers.model.model_config import ModelConfig, preset
from kvmesh.workers.model.paged_attention import (
    DECODE_TILE,
    PREFILL_TILE,
    PagedChunk,
    TileShape,
    build_paged_layout,
    paged_attention_reference,
)
from kvmesh.workers.model.runner import ModelRunner, SeqChunk

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

# ||out - ref|| / ||ref|| bounds (METHOD.md): bf16 operands land between 1e-3 and 1e-2.
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def run_case(
    *,
    dtype: torch.dtype,
    group: int,
    head_dim: int,
    page: int,
    shapes: list[tuple[int, int]],
    tile: TileShape,
    num_splits: int | None,
    seed: int,
) -> None:
    from kvmesh.workers.model.paged_attention_kernel import launch_paged_attention

    gen = torch.Generator(device="cuda").manual_seed(seed)
    rng = random.Random(seed)
    num_kv_heads, num_blocks = 2, sum(-(-s // page) for s, _ in shapes) + 8
    cache_shape = (num_blocks, page, num_kv_heads, head_dim)
    k = torch.randn(cache_shape, device="cuda", generator=gen).to(dtype)
    v = torch.randn(cache_shape, device="cuda", generator=gen).to(dtype)
    num_rows = sum(q for _, q in shapes) + 5
    q = torch.randn((num_rows, num_kv_heads * group, head_dim), device="cuda", generator=gen)
    q = q.to(dtype)
    free = rng.sample(range(num_blocks), num_blocks)
    chunks, row = [], 3  # rows 0-2 and the tail belong to nobody: they must stay untouched
    for seq_len, query_len in shapes:
        table = [free.pop() for _ in range(-(-seq_len // page))]
        chunks.append(PagedChunk(seq_len, query_len, row, table))
        row += query_len
    layout = build_paged_layout(
        chunks,
        block_size=page,
        num_queries_per_kv=group,
        tile=tile,
        device=torch.device("cuda"),
    )
    got = torch.full_like(q, float("nan"))
    want = torch.full_like(q, float("nan"))
    launch_paged_attention(q, k, v, got, layout, num_sms=132, num_splits=num_splits)
    paged_attention_reference(q, k, v, want, layout)
    torch.cuda.synchronize()
    written = ~torch.isnan(want)
    assert torch.equal(~torch.isnan(got), written), "kernel wrote other rows than the reference"
    err = (got[written].double() - want[written].double()).norm() / want[written].double().norm()
    assert err.item() < TOLERANCE[dtype], err.item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize(("group", "head_dim"), [(4, 128), (4, 64), (1, 64), (7, 64)])
def test_decode_kernel_matches_reference(
    dtype: torch.dtype, num_splits: int | None, group: int, head_dim: int
) -> None:
    shapes = [(1, 1), (17, 1), (300, 1), (2048, 1), (1000, 1), (64, 1)]
    run_case(
        dtype=dtype,
        group=group,
        head_dim=head_dim,
        page=16,
        shapes=shapes,
        tile=DECODE_TILE,
        num_splits=num_splits,
        seed=group * 1000 + head_dim,
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_splits", [None, 1, 4])
@pytest.mark.parametrize("page", [16, 32, 5])
def test_prefill_kernel_matches_reference_with_bottom_right_causality(
    dtype: torch.dtype, num_splits: int | None, page: int
) -> None:
    shapes = [(1500, 512), (100, 37), (40, 40), (777, 1), (3000, 129)]
    run_case(
        dtype=dtype,
        group=4,
        head_dim=128,
        page=page,
        shapes=shapes,
        tile=PREFILL_TILE,
        num_splits=num_splits,
        seed=page,
    )


def small_config() -> ModelConfig:
    return dataclasses.replace(
        preset("tiny-random"),
        hidden_size=512,
        intermediate_size=1024,
        num_layers=2,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "mode",
    [
        AttentionMode(paged_decode=True, paged_prefill=True, explicit_masks=False),
        AttentionMode(paged_decode=False, paged_prefill=False, explicit_masks=False),
        AttentionMode(
            paged_decode=True, paged_prefill=False, explicit_masks=False, split_prefill=True
        ),
        AttentionMode(
            paged_decode=True, paged_prefill=True, explicit_masks=False, bucketed_prefill=True
        ),
        pytest.param(
            AttentionMode(
                paged_decode=True,
                paged_prefill=True,
                explicit_masks=False,
                bucketed_prefill=True,
                cudnn_pages=True,
            ),
            marks=pytest.mark.skipif(
                not torch.cuda.is_available() or not cudnn_pages_usable(torch.device("cuda")),
                reason="needs a Hopper card and the cuDNN frontend's bindings",
            ),
        ),
    ],
    ids=["triton", "gather+flash", "split", "bucketed", "cudnn_pages"],
)
def test_runner_gpu_paths_match_the_explicit_mask_path(
    mode: AttentionMode, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    if mode.cudnn_pages and dtype == torch.float32:
        pytest.skip("cuDNN's fused attention runs bf16 / fp16 only")
    # Prefixes of 40 and 700 tokens split at bucketed points; the 17- and 90-token ones stay paged.
    monkeypatch.setattr(batch_plan, "BUCKETED_MIN_PREFIX", 32)
    monkeypatch.setattr(batch_plan, "BUCKETED_MIN_NEW", 2)
    config = small_config()
    shapes = [(0, 150), (40, 60), (90, 1), (17, 1), (0, 1), (700, 300), (1200, 1)]
    rng = random.Random(3)
    seqs = [[rng.randrange(256) for _ in range(a + b)] for a, b in shapes]
    tables = [list(range(100 * i, 100 * i + 100)) for i in range(len(shapes))]
    results = []
    weights = None
    for m in (AttentionMode(False, False, True), mode):
        runner = ModelRunner(config, 800, 16, device="cuda", dtype=dtype, weights=weights)
        weights = runner.weights
        runner.attention.mode = m
        for ids, (cached, _), table in zip(seqs, shapes, tables, strict=True):
            if cached:
                runner.forward([SeqChunk(ids[:cached], 0, table)])
        chunks = [SeqChunk(s[a:], a, t) for s, (a, _), t in zip(seqs, shapes, tables, strict=True)]
        results.append(torch.cat(runner.forward_all_logits(chunks)))
    got, want = results[1], results[0]
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=5e-4, rtol=0)
    else:  # bf16 keeps 8 mantissa bits: compare the distribution, not digits
        assert (got - want).abs().max().item() < 0.08 * want.abs().max().item()
        cosine = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)
        assert cosine.item() > 0.999


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("prefix_len", "query_len"), [(7680, 512), (1500, 37), (5, 300), (1, 2)])
def test_split_prefix_attention_matches_float64_reference(
    dtype: torch.dtype, prefix_len: int, query_len: int
) -> None:
    """The fused parts (cuDNN on Hopper, else flash) and their merge vs one float64 softmax."""
    from kvmesh.workers.model.split_attention import SplitShape, split_prefix_attention

    gen = torch.Generator(device="cuda").manual_seed(prefix_len + query_len)
    heads, kv_heads, dim = 32, 8, 128
    total = prefix_len + query_len

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, device="cuda", generator=gen).to(dtype)

    q, k, v = randn(query_len, heads, dim), randn(total, kv_heads, dim), randn(total, kv_heads, dim)
    keys, values = (x.double().repeat_interleave(heads // kv_heads, dim=1) for x in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) / dim**0.5
    query_pos = torch.arange(prefix_len, total, device="cuda")
    hidden = torch.arange(total, device="cuda")[None, :] > query_pos[:, None]
    want = torch.einsum(
        "hqk,khd->qhd", scores.masked_fill(hidden, float("-inf")).softmax(-1), values
    )
    for shape in (
        SplitShape.exact(prefix_len, query_len),
        SplitShape.bucketed(prefix_len, query_len),
        SplitShape(max(1, prefix_len // 2), query_len + 5),  # a long causal tail, odd padding
    ):
        rows = torch.full((query_len + 6, heads, dim), float("nan"), device="cuda", dtype=dtype)
        got = rows[3 : 3 + query_len]  # rows around it belong to nobody: they must stay untouched
        split_prefix_attention(q, k, v, shape, got)
        assert rows[:3].isnan().all() and rows[3 + query_len :].isnan().all()
        error = (got.double() - want).norm() / want.norm()
        assert error.item() < TOLERANCE[dtype], (shape, error.item())
