"""The split prefill attention on CPU: its bucketed shapes, and its parts merged against float64."""

from __future__ import annotations

import math

import pytest
import torch

from kvmesh.workers.model.split_attention import SplitShape, split_prefix_attention


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Float64 attention of q [n, heads, d] as the last n of keys [m, kv_heads, d]."""
    n, m = q.shape[0], keys.shape[0]
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1).transpose(0, 1)
    v = values.double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q.double().transpose(0, 1) @ k.transpose(1, 2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(torch.ones(n, m, dtype=torch.bool).triu(m - n + 1), -math.inf)
    return (torch.softmax(scores, -1) @ v).transpose(0, 1)


def test_bucketed_shapes_split_inside_the_prefix_and_pad_the_rows_a_little() -> None:
    for prefix in (1, 2, 7, 100, 2048, 2049, 5000, 7680, 8191, 65_537):
        for n in (1, 2, 63, 64, 65, 300, 512, 513, 2047):
            split, padded = SplitShape.bucketed(prefix, n)
            assert 1 <= split <= prefix
            assert prefix - split <= prefix // 8  # the tail is under an eighth of the prefix
            assert n <= padded <= max(64, 2 * n - 1)
    assert SplitShape.bucketed(7680, 512) == (7680, 512)  # on the grid: nothing moves
    assert SplitShape.bucketed(7000, 300) == (6656, 512)


def test_bucketed_shapes_are_few_and_all_warmed() -> None:
    """Every prefix of 2K-16K tokens with every chunk of 512-2K tokens: 72 cuDNN shapes, where
    the exact split would need one per (prefix, chunk) pair (~21 million); `all_bucketed` lists
    each of them and nothing else."""
    seen = {
        SplitShape.bucketed(p, n)
        for p in range(2048, 16_384, 7)
        for n in (512, 513, 1000, 1024, 1025, 2048)
    }
    warmed = SplitShape.all_bucketed(2048, 16_384, 512, 2048)
    assert len(warmed) == len(set(warmed)) == 72
    assert seen == set(warmed)
    assert len(SplitShape.all_bucketed(2048, 16_384, 1, 2048)) == 24 * 6  # rows from 64 up
    assert SplitShape.all_bucketed(2048, 2048, 512, 512) == []  # no room past the split
    assert SplitShape.exact(5000, 300) == (5000, 300)


@pytest.mark.parametrize(
    ("prefix", "n", "heads", "kv_heads"),
    [(40, 7, 4, 2), (333, 29, 8, 2), (1000, 65, 4, 4), (2100, 130, 8, 1)],
)
def test_split_attention_matches_float64(prefix: int, n: int, heads: int, kv_heads: int) -> None:
    gen = torch.Generator().manual_seed(prefix + n)
    q = torch.randn(n, heads, 16, generator=gen)
    keys = torch.randn(prefix + n, kv_heads, 16, generator=gen) * 2
    values = torch.randn(prefix + n, kv_heads, 16, generator=gen)
    expected = reference(q, keys, values)
    for shape in (SplitShape.exact(prefix, n), SplitShape.bucketed(prefix, n), (1, n + 3)):
        out = torch.full_like(q, math.nan)
        split_prefix_attention(q, keys, values, SplitShape(*shape), out)
        torch.testing.assert_close(out.double(), expected, atol=2e-6, rtol=0)


def test_split_attention_refuses_a_split_outside_the_prefix() -> None:
    q, keys = torch.randn(4, 2, 8), torch.randn(10, 1, 8)
    out = torch.empty_like(q)
    for shape in ((0, 4), (7, 4), (3, 3)):  # split 0, past the prefix of 6, rows < n
        with pytest.raises(ValueError, match="split"):
            split_prefix_attention(q, keys, keys, SplitShape(*shape), out)
