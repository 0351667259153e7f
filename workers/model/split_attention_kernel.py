"""The Triton kernel that merges the two partials of `split_attention` into the output rows.

Imported only on CUDA (and by the kernel tests under Triton's interpreter). One program owns
`BLOCK_T` tokens of one query head: it reads that head's prefix partial from the folded layout
(row g * padded + i of KV head h // group, g = h % group), the causal part's partial, both
log-sum-exps, and writes the softmax-weighted sum straight into the output rows, in one pass.

    grid (ceil(n / BLOCK_T), num_heads)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_T = 16


@triton.jit(do_not_specialize=["num_tokens", "padded_tokens"])  # one compile for all lengths
def _merge_kernel(
    prefix_out_ptr,
    prefix_lse_ptr,
    own_out_ptr,
    own_lse_ptr,
    out_ptr,
    num_tokens,
    padded_tokens,
    stride_po_h,
    stride_po_r,
    stride_pl_h,
    stride_pl_r,
    stride_oo_h,
    stride_oo_t,
    stride_ol_h,
    stride_ol_t,
    stride_out_t,
    stride_out_h,
    GROUP: tl.constexpr,
    DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    head = tl.program_id(1)
    kv_head = head // GROUP
    token = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    valid = token < num_tokens
    dims = tl.arange(0, DIM_PAD)
    cell = valid[:, None] & (dims[None, :] < DIM)
    folded_row = (head % GROUP) * padded_tokens + token
    lse_p = tl.load(
        prefix_lse_ptr + kv_head * stride_pl_h + folded_row * stride_pl_r, mask=valid, other=0.0
    )
    lse_o = tl.load(own_lse_ptr + head * stride_ol_h + token * stride_ol_t, mask=valid, other=0.0)
    top = tl.maximum(lse_p, lse_o)
    w_p = tl.exp(lse_p - top)
    w_o = tl.exp(lse_o - top)
    total = w_p + w_o
    part_p = tl.load(
        prefix_out_ptr + kv_head * stride_po_h + folded_row[:, None] * stride_po_r + dims[None, :],
        mask=cell,
        other=0.0,
    ).to(tl.float32)
    part_o = tl.load(
        own_out_ptr + head * stride_oo_h + token[:, None] * stride_oo_t + dims[None, :],
        mask=cell,
        other=0.0,
    ).to(tl.float32)
    merged = part_p * (w_p / total)[:, None] + part_o * (w_o / total)[:, None]
    tl.store(
        out_ptr + token[:, None] * stride_out_t + head * stride_out_h + dims[None, :],
        merged.to(out_ptr.dtype.element_ty),
        mask=cell,
    )


def launch_merge(
    prefix_out: torch.Tensor,
    prefix_lse: torch.Tensor,
    own_out: torch.Tensor,
    own_lse: torch.Tensor,
    out: torch.Tensor,
    padded_tokens: int,
) -> None:
    """prefix_out [kv_heads, group * padded_tokens, dim] and prefix_lse [kv_heads, group *
    padded_tokens] (folded rows, padded_tokens >= n);
    own_out [heads, n, dim] and own_lse [heads, n]; writes out [n, heads, dim]. Any strides, but
    the last dim of the three outputs must be contiguous."""
    num_tokens, num_heads, dim = out.shape
    kv_heads = prefix_out.shape[0]
    for name, t in (("prefix_out", prefix_out), ("own_out", own_out), ("out", out)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}'s last dim has stride {t.stride(-1)}, must be 1")
    grid = (triton.cdiv(num_tokens, _BLOCK_T), num_heads)
    _merge_kernel[grid](
        prefix_out,
        prefix_lse,
        own_out,
        own_lse,
        out,
        num_tokens,
        padded_tokens,
        prefix_out.stride(0),
        prefix_out.stride(1),
        prefix_lse.stride(0),
        prefix_lse.stride(1),
        own_out.stride(0),
        own_out.stride(1),
        own_lse.stride(0),
        own_lse.stride(1),
        out.stride(0),
        out.stride(1),
        GROUP=num_heads // kv_heads,
        DIM=dim,
        DIM_PAD=triton.next_power_of_2(dim),
        BLOCK_T=_BLOCK_T,
    )
