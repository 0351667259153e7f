"""Attention of a chunked prefill behind a cached prefix, split where causality starts to matter.

A chunk's new tokens are the last `n` positions of a `prefix_len + n` sequence. Every new token sees
the whole cached prefix, so all of it but the last few keys can go through one unmasked call; the
rest (the prefix's tail past the split point, then the new tokens themselves) is bottom-right
causal:

      keys:      0 .............. split - 1 | split ... prefix_len - 1 | prefix_len ... + n - 1
      queries:   |------- no mask ---------| |---- bottom-right causal (tail + n x n) -----|
                     partial A, lse A                      partial B, lse B

The unmasked part folds the query heads that share a KV head into the rows of one query, so K/V is
read once per KV head and no mask exists; it carries almost all the FLOPs and runs on cuDNN's
fused attention (Hopper and newer), the fastest kernel for an unmasked block. The causal part runs
on flash attention's own entry, which takes grouped KV heads natively and aligns the causal mask
bottom-right. The two partials merge exactly through their log-sum-exps: out = sum_p
softmax(lse)_p * out_p, in one Triton kernel that writes the output rows.

cuDNN builds an execution plan for every new shape (~50 ms on an H100, ~600 ms the first time),
and a server meets new (prefix, chunk) lengths all the time. So the unmasked part's shape is
*bucketed* (`SplitShape`): its keys stop at the largest grid point at or below `prefix_len` (8
points an octave, so the tail is under 1/8 of the prefix) and its query rows are padded up to a
power of two (padding rows are zeros whose outputs are dropped; rows are independent). 72 plans
cover every chunk of 512-2K tokens behind a prefix of 2-16K (the chunks the runner splits, see
`batch_plan`), built before a worker serves (`all_bucketed`). On CPU the
same split runs in plain float32 math (tests check the split, the bucketing and the merge there;
the GPU tests check the fused kernels against the float64 reference).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

__all__ = [
    "AttentionPart",
    "SplitShape",
    "attention_part",
    "causal_tail_part",
    "cudnn_attention_usable",
    "merge_parts",
    "split_prefix_attention",
]

MIN_PADDED_ROWS = 64
"""The smallest padded chunk (in tokens) of the bucketed unmasked part."""


class AttentionPart(NamedTuple):
    """One part's normalised output and its log-sum-exp (natural log, float32): the unmasked
    part folded ([kv_heads, rows, dim], [kv_heads, rows]), the causal part per head ([heads, n,
    dim], [heads, n])."""

    out: torch.Tensor
    lse: torch.Tensor


class SplitShape(NamedTuple):
    """Where a chunk's attention splits: keys [0, split) unmasked, with the chunk's n tokens
    padded to `padded_tokens` query rows per head of a KV group."""

    split: int
    padded_tokens: int

    @classmethod
    def exact(cls, prefix_len: int, num_new: int) -> SplitShape:
        """Split at the prefix boundary, no padding: a cuDNN plan per (prefix, chunk) length."""
        return cls(prefix_len, num_new)

    @classmethod
    def bucketed(cls, prefix_len: int, num_new: int) -> SplitShape:
        """Split at the largest grid point <= prefix_len (8 an octave), rows padded up to a power
        of two (at least `MIN_PADDED_ROWS`): few distinct shapes, so few cuDNN plans."""
        return cls(_round_down(prefix_len, 3), max(MIN_PADDED_ROWS, _round_up(num_new, 0)))

    @staticmethod
    def all_bucketed(min_prefix: int, max_len: int, min_new: int, max_new: int) -> list[SplitShape]:
        """Every bucketed shape of a prefix >= min_prefix and a chunk of min_new..max_new tokens
        within max_len tokens (what a worker warms up before it serves)."""
        splits = sorted({_round_down(p, 3) for p in _grid(min_prefix, max_len)})
        rows = sorted({max(MIN_PADDED_ROWS, _round_up(n, 0)) for n in _grid(min_new, max_new)})
        return [SplitShape(s, r) for s in splits for r in rows if s < max_len and s >= min_prefix]


def _grid(low: int, high: int) -> list[int]:
    """low, high and every 1/16 of an octave between: enough to meet each bucket."""
    points, x = [low, high], max(low, 1)
    while x < high:
        points.append(x)
        x += max(1, x >> 4)
    return points


def _round_down(x: int, bits: int) -> int:
    """The largest m * 2^e <= x with m < 2^(bits + 1) (2^bits grid points an octave)."""
    if x < 1:
        return 0
    shift = max(0, x.bit_length() - 1 - bits)
    return (x >> shift) << shift


def _round_up(x: int, bits: int) -> int:
    """The smallest m * 2^e >= x with m <= 2^(bits + 1) (2^bits grid points an octave)."""
    if x <= 1:
        return max(x, 0)
    shift = max(0, (x - 1).bit_length() - 1 - bits)
    return -(-x >> shift) << shift


def cudnn_attention_usable(device: torch.device) -> bool:
    """cuDNN's fused attention with log-sum-exp: CUDA, cuDNN present, Hopper or newer."""
    return device.type == "cuda" and _cudnn_on_hopper(device.index)


@functools.cache
def _cudnn_on_hopper(device_index: int | None) -> bool:
    """Asked once per device, not once per layer."""
    capability = torch.cuda.get_device_capability(device_index)
    return torch.backends.cudnn.is_available() and capability[0] >= 9


def _fused(t: torch.Tensor) -> bool:
    return t.dtype in (torch.bfloat16, torch.float16) and t.device.type == "cuda"


def attention_part(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> AttentionPart:
    """Unmasked attention, q [1, h, m, d], k/v [1, h, n, d] (same heads; last dim contiguous)
    -> its partial ([h, m, d], [h, m]), at the default scale 1 / sqrt(d). Fused kernels (bf16 /
    fp16 on CUDA) may return outputs with any strides; float32 runs the math."""
    if _fused(q):
        if cudnn_attention_usable(q.device):
            result = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True)
        else:
            result = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v)
        return AttentionPart(result[0][0], result[1].reshape(q.shape[1:3]))
    scores = (q[0].float() @ k[0].float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    lse = torch.logsumexp(scores, dim=-1)
    out = (scores - lse[..., None]).exp() @ v[0].float()
    return AttentionPart(out.to(q.dtype), lse)


def causal_tail_part(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> AttentionPart:
    """q [n, heads, d] over k/v [m, kv_heads, d] (m >= n), bottom-right causal: query i sees keys
    <= i + m - n. Returns ([heads, n, d], [heads, n]); query head h uses KV head h // group."""
    n, m = q.shape[0], k.shape[0]
    if _fused(q):
        result = torch.ops.aten._flash_attention_forward(
            q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), None, None, n, m, 0.0, True, False
        )
        return AttentionPart(result[0][0].transpose(0, 1), result[1][0])
    group = q.shape[1] // k.shape[1]
    keys = k.float().repeat_interleave(group, dim=1).transpose(0, 1)
    values = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = (q.float().transpose(0, 1) @ keys.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    hidden = torch.ones(n, m, dtype=torch.bool, device=q.device).triu(m - n + 1)
    scores = scores.masked_fill(hidden, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    out = (scores - lse[..., None]).exp() @ values
    return AttentionPart(out.to(q.dtype), lse)


def merge_parts(
    unmasked: AttentionPart, causal: AttentionPart, padded_tokens: int, out: torch.Tensor
) -> None:
    """Write the exact softmax merge of the two partials into out [n, heads, dim]: `unmasked`
    folded (row g * padded_tokens + i of KV head j is query head j * group + g, token i),
    `causal` per head."""
    n, heads, dim = out.shape
    kv_heads = unmasked.out.shape[0]
    group = heads // kv_heads
    if out.device.type == "cuda":
        from kvmesh.workers.model.split_attention_kernel import launch_merge

        launch_merge(unmasked.out, unmasked.lse, causal.out, causal.lse, out, padded_tokens)
        return
    # [n, heads, ...] views of both partials; head h = kv_head * group + g, row (g, i).
    folded_out = unmasked.out.reshape(kv_heads, group, padded_tokens, dim)[:, :, :n]
    folded_lse = unmasked.lse.reshape(kv_heads, group, padded_tokens)[:, :, :n]
    lse = torch.stack([folded_lse.permute(2, 0, 1).reshape(n, heads), causal.lse.transpose(0, 1)])
    weights = torch.softmax(lse, dim=0).unsqueeze(-1)
    merged = folded_out.permute(2, 0, 1, 3).reshape(n, heads, dim).float() * weights[0]
    merged += causal.out.transpose(0, 1).float() * weights[1]
    out.copy_(merged)


def split_prefix_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    shape: SplitShape,
    out: torch.Tensor,
) -> None:
    """Attention of n new tokens behind a cached prefix, written into out [n, heads, dim].

    q [n, heads, dim]; keys/values [prefix_len + n, kv_heads, dim], the new tokens' own last;
    `shape` says where to split (1 <= split <= prefix_len) and how far to pad the folded rows.
    Query head h uses KV head h // (heads / kv_heads).
    """
    n, heads, dim = q.shape
    prefix_len, kv_heads = keys.shape[0] - n, keys.shape[1]
    split, padded = shape
    if not 1 <= split <= prefix_len or padded < n or heads % kv_heads:
        raise ValueError(
            f"need 1 <= split <= prefix, padded rows >= n and heads divisible by kv_heads, got "
            f"split {split}, prefix {prefix_len}, padded {padded}, n {n}, heads {heads}, "
            f"kv_heads {kv_heads}"
        )
    group = heads // kv_heads
    # Rows (g, i) of KV head j: query head j * group + g, token i; rows i >= n are zeros.
    folded = q.new_zeros((kv_heads, group, padded, dim))
    folded[:, :, :n] = q.view(n, kv_heads, group, dim).permute(1, 2, 0, 3)
    unmasked = attention_part(
        folded.view(1, kv_heads, group * padded, dim),
        keys[:split].transpose(0, 1).unsqueeze(0),
        values[:split].transpose(0, 1).unsqueeze(0),
    )
    causal = causal_tail_part(q, keys[split:], values[split:])
    merge_parts(unmasked, causal, padded, out)
