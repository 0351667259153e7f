"""Attention of a chunked prefill behind a cached prefix, split where causality starts to matter.

A chunk's new tokens are the last `n` positions of a `prefix_len + n` sequence. Every new token sees
the whole cached prefix, so that part has no mask at all; only the `n x n` square of the new tokens
among themselves is causal (and, being square, top-left and bottom-right alignment agree):

      keys:      0 ........... prefix_len - 1 | prefix_len ...... prefix_len + n - 1
      queries:   |------- no mask -----------| |---- causal square (n x n) ----|
                       partial A, lse A                partial B, lse B

Each part runs through a fused attention kernel that returns its log-sum-exp (cuDNN's on Hopper
and newer, else flash), and the two partials merge exactly: out = sum_p softmax(lse)_p * out_p.
The unmasked part folds the query heads that share a KV head into the rows of one query, so K/V is
read once per KV head and no mask tensor exists; that is where almost all the FLOPs are, at the
fused kernel's fresh-prompt rate. On CPU the same split runs in plain float32 math (tests check
the split and the merge there; the GPU tests check the fused kernels against the float64
reference).

Opt-in (`AttentionMode.split_prefill`), not the default: cuDNN builds an execution plan per new
shape, ~120 ms each on an H100, which a server meeting new prompt lengths pays again and again.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

__all__ = [
    "AttentionPart",
    "attention_part",
    "cudnn_attention_usable",
    "merge_parts",
    "split_prefix_attention",
]


class AttentionPart(NamedTuple):
    """One part's normalised output [1, heads, rows, dim] and its log-sum-exp [1, heads, rows]
    (natural log, float32)."""

    out: torch.Tensor
    lse: torch.Tensor


def cudnn_attention_usable(device: torch.device) -> bool:
    """cuDNN's fused attention with log-sum-exp: CUDA, cuDNN present, Hopper or newer."""
    return device.type == "cuda" and _cudnn_on_hopper(device.index)


@functools.cache
def _cudnn_on_hopper(device_index: int | None) -> bool:
    """Asked once per device, not once per layer."""
    capability = torch.cuda.get_device_capability(device_index)
    return torch.backends.cudnn.is_available() and capability[0] >= 9


def attention_part(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool
) -> AttentionPart:
    """q [1, h, m, d], k/v [1, h, n, d] (same heads; last dim contiguous) -> its partial, at
    the default scale 1 / sqrt(d). `causal` is the plain top-left mask; callers only ask for it
    on square parts. Fused kernels (bf16 / fp16 on CUDA) may return outputs with any strides;
    float32 runs the math."""
    if q.dtype in (torch.bfloat16, torch.float16) and q.device.type == "cuda":
        if cudnn_attention_usable(q.device):
            result = torch.ops.aten._scaled_dot_product_cudnn_attention(
                q, k, v, None, True, 0.0, causal, False
            )
        else:
            result = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False)
        return AttentionPart(result[0], result[1].reshape(q.shape[:3]))
    scores = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        m, n = scores.shape[-2:]
        scores = scores.masked_fill(
            torch.ones(m, n, dtype=torch.bool, device=q.device).triu(1), -math.inf
        )
    lse = torch.logsumexp(scores, dim=-1)
    out = (scores - lse[..., None]).exp() @ v.float()
    return AttentionPart(out.to(q.dtype), lse)


def merge_parts(prefix: AttentionPart, own: AttentionPart, group: int, out: torch.Tensor) -> None:
    """Write the exact softmax merge of the two partials into out [n, heads, dim]: `prefix` in
    the folded layout ([1, kv_heads, group * n, ...]), `own` per head ([1, heads, n, ...])."""
    n, heads, dim = out.shape
    kv_heads = heads // group
    prefix_out, prefix_lse = prefix.out[0], prefix.lse[0]
    own_out, own_lse = own.out[0], own.lse[0]
    if out.device.type == "cuda":
        from kvmesh.workers.model.split_attention_kernel import launch_merge

        launch_merge(prefix_out, prefix_lse, own_out, own_lse, out)
        return
    # [n, heads, ...] views of both partials; head h = kv_head * group + g, row (g, i).
    unfolded_out = prefix_out.reshape(kv_heads, group, n, dim).permute(2, 0, 1, 3)
    unfolded_lse = prefix_lse.reshape(kv_heads, group, n).permute(2, 0, 1)
    weights = torch.softmax(
        torch.stack([unfolded_lse.reshape(n, heads), own_lse.transpose(0, 1)]), dim=0
    ).unsqueeze(-1)
    merged = unfolded_out.reshape(n, heads, dim).float() * weights[0]
    merged += own_out.transpose(0, 1).float() * weights[1]
    out.copy_(merged)


def split_prefix_attention(
    q: torch.Tensor,
    prefix_k: torch.Tensor,
    prefix_v: torch.Tensor,
    new_k: torch.Tensor,
    new_v: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """Attention of n new tokens behind a cached prefix, written into out [n, heads, dim].

    q [n, heads, dim]; prefix_k/v [prefix_len, kv_heads, dim] (prefix_len >= 1);
    new_k/v [n, kv_heads, dim]. Query head h uses KV head h // (heads / kv_heads).
    """
    n, heads, dim = q.shape
    kv_heads = prefix_k.shape[1]
    if prefix_k.shape[0] < 1 or heads % kv_heads:
        raise ValueError(
            f"need a non-empty prefix and heads divisible by kv_heads, got prefix "
            f"{prefix_k.shape[0]}, heads {heads}, kv_heads {kv_heads}"
        )
    group = heads // kv_heads
    # Rows (g, i) of KV head j: query head j * group + g, token i.
    folded = q.view(n, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(1, kv_heads, -1, dim)
    prefix = attention_part(
        folded,
        prefix_k.transpose(0, 1).unsqueeze(0),
        prefix_v.transpose(0, 1).unsqueeze(0),
        causal=False,
    )
    own = attention_part(
        q.transpose(0, 1).unsqueeze(0),
        new_k.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0),
        new_v.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0),
        causal=True,
    )
    merge_parts(prefix, own, group, out)
