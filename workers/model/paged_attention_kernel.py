"""The Triton kernels behind `paged_attention` (see that module for the layout and the contract).

Imported only on CUDA: this is the one module that imports triton.

Each program owns one tile of query rows (tokens x the query heads of one KV head) and one split of
the key range, and runs an online softmax over that split, reading K/V through the block table.
When the grid would leave SMs idle (few sequences, long contexts) the key range is split across
programs (flash-decoding); each split writes its normalised partial output and log-sum-exp, and a
second kernel merges them. Scores are in the log2 domain (exp2 is one instruction).

    grid (num_tiles, num_kv_heads, num_splits)      split s covers keys [s * split_len, ...)
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvmesh.workers.model.paged_attention import PagedLayout

_LOG2E = 1.4426950408889634


@triton.jit
def _load_tile_rows(
    seq_meta_ptr,
    tile_meta_ptr,
    num_seqs,
    num_tiles,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Per-row facts of this program's tile: token index in the chunk, query head, validity."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_meta_ptr + tile)
    first = tl.load(tile_meta_ptr + num_tiles + tile)
    seq_len = tl.load(seq_meta_ptr + seq)
    query_len = tl.load(seq_meta_ptr + num_seqs + seq)
    query_row = tl.load(seq_meta_ptr + 2 * num_seqs + seq)
    local_start = tl.load(seq_meta_ptr + 3 * num_seqs + seq)
    rows = tl.arange(0, BLOCK_M)
    token = first + rows // GROUP_PAD
    in_group = rows % GROUP_PAD
    valid = (token < query_len) & (in_group < GROUP)
    head = kv_head * GROUP + in_group
    return seq, first, seq_len, query_len, query_row, local_start, token, head, valid


# Triton compiles a kernel again for each new class of its integer arguments (== 1, divisible by
# 16): the sizes and the table's stride change with every batch, so new lengths cost 1-3 s compiles
# in the middle of serving. These stay unspecialised: one compile per tile shape.
_PER_BATCH = ["num_seqs", "num_tiles", "num_local_tokens"]


@triton.jit(do_not_specialize=[*_PER_BATCH, "split_len", "stride_bt"])
def _paged_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    block_tables_ptr,
    seq_meta_ptr,
    tile_meta_ptr,
    num_seqs,
    num_tiles,
    num_local_tokens,
    split_len,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_bt,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    IEEE: tl.constexpr,
):
    seq, first, seq_len, query_len, query_row, local_start, token, head, valid = _load_tile_rows(
        seq_meta_ptr, tile_meta_ptr, num_seqs, num_tiles, GROUP, GROUP_PAD, BLOCK_M
    )
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q = tl.load(
        q_ptr
        + (query_row + token)[:, None] * stride_qt
        + head[:, None] * stride_qh
        + dims[None, :],
        mask=valid[:, None] & dim_ok[None, :],
        other=0.0,
    )
    query_pos = seq_len - query_len + token
    # Causality bounds the keys this tile can see by its last valid token's position.
    last_token = tl.minimum(first + BLOCK_M // GROUP_PAD, query_len) - 1
    key_stop = tl.minimum((split + 1) * split_len, seq_len - query_len + last_token + 1)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    for start in range(split * split_len, key_stop, BLOCK_N):
        key_pos = start + tl.arange(0, BLOCK_N)
        key_ok = key_pos < key_stop
        page = tl.load(table + key_pos // PAGE_SIZE, mask=key_ok, other=0).to(tl.int64)
        in_page = key_pos % PAGE_SIZE
        k_rows = page * stride_kb + in_page * stride_kt + kv_head * stride_kh
        k = tl.load(
            k_ptr + k_rows[None, :] + dims[:, None],
            mask=key_ok[None, :] & dim_ok[:, None],
            other=0.0,
        )
        if IEEE:
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        allowed = key_ok[None, :] & (key_pos[None, :] <= query_pos[:, None])
        s = tl.where(allowed, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with nothing visible yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_shift)
        p = tl.exp2(s - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_rows = page * stride_vb + in_page * stride_vt + kv_head * stride_vh
        v = tl.load(
            v_ptr + v_rows[:, None] + dims[None, :],
            mask=key_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    seen = l_i > 0.0
    normed = acc / tl.where(seen, l_i, 1.0)[:, None]
    if SPLIT:
        local = (split * num_local_tokens + local_start + token).to(tl.int64) * NUM_HEADS + head
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + local, lse, mask=valid)
        tl.store(
            part_out_ptr + local[:, None] * HEAD_DIM_PAD + dims[None, :],
            normed,
            mask=valid[:, None],
        )
    else:
        dest = (query_row + token)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(
            out_ptr + dest,
            normed.to(out_ptr.dtype.element_ty),
            mask=valid[:, None] & dim_ok[None, :],
        )


@triton.jit(do_not_specialize=[*_PER_BATCH, "num_splits"])
def _merge_splits_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    seq_meta_ptr,
    tile_meta_ptr,
    num_seqs,
    num_tiles,
    num_local_tokens,
    num_splits,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    _, _, _, _, query_row, local_start, token, head, valid = _load_tile_rows(
        seq_meta_ptr, tile_meta_ptr, num_seqs, num_tiles, GROUP, GROUP_PAD, BLOCK_M
    )
    dims = tl.arange(0, HEAD_DIM_PAD)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    weight = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    for split in range(num_splits):
        local = (split * num_local_tokens + local_start + token).to(tl.int64) * NUM_HEADS + head
        lse = tl.load(part_lse_ptr + local, mask=valid, other=float("-inf"))
        part = tl.load(
            part_out_ptr + local[:, None] * HEAD_DIM_PAD + dims[None, :],
            mask=valid[:, None],
            other=0.0,
        )
        m_new = tl.maximum(m, lse)
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_shift)
        w = tl.exp2(lse - m_shift)
        acc = acc * alpha[:, None] + w[:, None] * part
        weight = weight * alpha + w
        m = m_new
    normed = acc / tl.where(weight > 0.0, weight, 1.0)[:, None]
    dest = (query_row + token)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
    tl.store(
        out_ptr + dest,
        normed.to(out_ptr.dtype.element_ty),
        mask=valid[:, None] & (dims < HEAD_DIM)[None, :],
    )


def choose_splits(layout: PagedLayout, num_kv_heads: int, num_sms: int) -> tuple[int, int]:
    """(num_splits, split_len): split only until every SM has a program, each split at least
    `min_split_len` keys and a whole number of key steps.

    Measured on an H200 (batch 32 x 2K, 256 programs): 1 split 92 us, 2 splits 85 us, 3 splits
    97 us. Splitting a grid that already fills the GPU gains little, and each split costs a merge
    launch, which matters more than 7 us while decode is bound by host launch overhead.
    """
    tile = layout.tile
    programs = layout.num_tiles * num_kv_heads
    wanted = -(-num_sms // programs)
    by_length = max(1, layout.max_seq_len // tile.min_split_len)
    num_splits = max(1, min(wanted, by_length))
    return _even_splits(layout.max_seq_len, num_splits, tile.block_n)


def _even_splits(max_seq_len: int, num_splits: int, block_n: int) -> tuple[int, int]:
    """Split lengths rounded up to whole key steps can leave the last split empty: recount."""
    split_len = -(-max_seq_len // num_splits)
    split_len = -(-split_len // block_n) * block_n
    return -(-max_seq_len // split_len), split_len


def _head_dim_pad(head_dim: int) -> int:
    """Head dim as the kernels tile it: a power of two, at least the tensor-core minimum 16."""
    return max(16, triton.next_power_of_2(head_dim))


def _split_buffers(
    q: torch.Tensor, layout: PagedLayout, num_splits: int, head_dim_pad: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial outputs, log-sum-exps) of every split; 1-element stand-ins when unsplit."""
    if num_splits == 1:
        empty = torch.empty((1,), device=q.device, dtype=torch.float32)
        return empty, empty
    shape = (num_splits, layout.num_local_tokens, q.shape[1])
    part_out = torch.empty((*shape, head_dim_pad), device=q.device, dtype=torch.float32)
    return part_out, torch.empty(shape, device=q.device, dtype=torch.float32)


def launch_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    layout: PagedLayout,
    *,
    num_sms: int,
    num_splits: int | None = None,
) -> None:
    """See `paged_attention.paged_attention`; `num_splits` overrides the heuristic (benchmarks)."""
    num_kv_heads, head_dim = k_cache.shape[2:]
    if q.stride(-1) != 1 or out.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("q, out and the caches need a contiguous last dimension")
    if v_cache.stride() != k_cache.stride():
        raise ValueError(f"k/v cache strides differ: {k_cache.stride()} vs {v_cache.stride()}")
    if num_splits is None:
        num_splits, split_len = choose_splits(layout, num_kv_heads, num_sms)
    else:
        num_splits, split_len = _even_splits(layout.max_seq_len, num_splits, layout.tile.block_n)
    buffers = _split_buffers(q, layout, num_splits, _head_dim_pad(head_dim))
    _launch(q, k_cache, v_cache, out, buffers, layout, num_splits, split_len)


def _launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    split_buffers: tuple[torch.Tensor, torch.Tensor],
    layout: PagedLayout,
    num_splits: int,
    split_len: int,
) -> None:
    """The attention kernel, then (when the keys are split) the merge kernel."""
    _, page_size, num_kv_heads, head_dim = k_cache.shape
    part_out, part_lse = split_buffers
    tile = layout.tile
    constants = {
        "NUM_HEADS": q.shape[1],
        "GROUP": q.shape[1] // num_kv_heads,
        "GROUP_PAD": layout.group_pad,
        "HEAD_DIM": head_dim,
        "HEAD_DIM_PAD": _head_dim_pad(head_dim),
        "BLOCK_M": tile.rows(layout.group_pad),
    }
    # Argument order of the kernel: q (token, head), k and v (block, slot, head), out, table.
    strides = (*q.stride()[:2], *k_cache.stride()[:3], *v_cache.stride()[:3], *out.stride()[:2])
    meta = (layout.block_tables, layout.seq_meta, layout.tile_meta)
    sizes = (layout.seq_meta.shape[1], layout.num_tiles, layout.num_local_tokens)
    tensors = (q, k_cache, v_cache, out, part_out, part_lse)
    scalars = (split_len, _LOG2E / math.sqrt(head_dim))
    options = {
        "PAGE_SIZE": page_size,
        "BLOCK_N": tile.block_n,
        "SPLIT": num_splits > 1,
        "IEEE": q.dtype == torch.float32,
        "num_warps": tile.num_warps,
        "num_stages": tile.num_stages,
    }
    grid = (layout.num_tiles, num_kv_heads, num_splits)
    _paged_attention_kernel[grid](
        *tensors,
        *meta,
        *sizes,
        *scalars,
        *strides,
        layout.block_tables.stride(0),
        **options,
        **constants,
    )
    if num_splits > 1:
        _merge_splits_kernel[grid[:2]](
            out,
            part_out,
            part_lse,
            *meta[1:],
            *sizes,
            num_splits,
            *out.stride()[:2],
            num_warps=4,
            **constants,
        )
