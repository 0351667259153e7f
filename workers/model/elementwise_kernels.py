"""Triton kernels for a layer's elementwise work on CUDA: one pass where torch takes several.

  * `rope_qk`: RoPE on the query and key heads straight out of the fused qkv projection, into
    new contiguous q and k (torch: a multiply, a roll and a multiply-add, each a full pass over q
    and k, into one [tokens, q + k heads, dim] tensor), and in the same pass the keys and values
    into the paged cache (torch: two `index_copy_`, the values' first made contiguous).
  * `silu_mul`: SiLU(gate) x up from the fused gate/up projection (torch: a SiLU pass, then a
    multiply reading both halves again).
  * `add_rms_norm`: the residual add and the next block's RMSNorm in one pass over the row (torch:
    the add, then the norm reading the sum back).

Each rounds where the torch expression it replaces rounds (`apply_rope`: x * cos to the model
dtype, then the multiply-add; SiLU to the model dtype, then the product; the residual sum to the
model dtype, then the norm in float32), so results equal torch's up to the last bit of a float32
multiply-add or sum. Imported only on CUDA (and by the tests under Triton's interpreter).

    rope_qk       grid (tokens, ceil(q + k (+ v) heads / BLOCK_H))
    silu_mul      grid (tokens, ceil(intermediate / BLOCK_I))
    add_rms_norm  grid (tokens,): one program a row
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

_BLOCK_H = 8
_BLOCK_I = 1024


@triton.jit
def _rope_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    q_ptr,
    k_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slots_ptr,
    num_heads,
    num_qk_heads,
    stride_qkv_t,
    stride_cos_t,
    DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    WRITE_KV: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, DIM)
    rolled = (dims + DIM // 2) % DIM  # x.roll(DIM // 2): element i reads i + DIM / 2
    num_kv_heads = num_qk_heads - num_heads
    # With WRITE_KV the programs also cover the value heads, which follow the key heads in qkv.
    num_read = num_qk_heads + num_kv_heads if WRITE_KV else num_qk_heads
    read = (heads < num_read)[:, None]
    row = qkv_ptr + token * stride_qkv_t + heads[:, None] * DIM
    x = tl.load(row + dims[None, :], mask=read, other=0.0)
    x_rolled = tl.load(row + rolled[None, :], mask=read, other=0.0)
    cos = tl.load(cos_ptr + token * stride_cos_t + dims)
    sin = tl.load(sin_ptr + token * stride_cos_t + dims)
    scaled = (x.to(tl.float32) * cos.to(tl.float32)[None, :]).to(x.dtype)
    out = (scaled.to(tl.float32) + x_rolled.to(tl.float32) * sin.to(tl.float32)[None, :]).to(
        x.dtype
    )
    is_q = (heads < num_heads)[:, None]
    tl.store(q_ptr + (token * num_heads + heads[:, None]) * DIM + dims[None, :], out, mask=is_q)
    k_head = (heads - num_heads)[:, None]
    is_k = (k_head >= 0) & (heads < num_qk_heads)[:, None]
    tl.store(k_ptr + (token * num_kv_heads + k_head) * DIM + dims[None, :], out, mask=is_k)
    if WRITE_KV:
        # The cache row of this token's slot: [slot, kv head, dim], as index_copy_ writes it.
        slot_row = tl.load(slots_ptr + token).to(tl.int64) * num_kv_heads
        tl.store(k_cache_ptr + (slot_row + k_head) * DIM + dims[None, :], out, mask=is_k)
        v_head = (heads - num_qk_heads)[:, None]
        is_v = read & (v_head >= 0)
        tl.store(v_cache_ptr + (slot_row + v_head) * DIM + dims[None, :], x, mask=is_v)


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr,
    out_ptr,
    size,
    stride_in_t,
    stride_out_t,
    BLOCK_I: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    ok = cols < size
    gate = tl.load(gate_up_ptr + token * stride_in_t + cols, mask=ok, other=0.0)
    up = tl.load(gate_up_ptr + token * stride_in_t + size + cols, mask=ok, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    out = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + token * stride_out_t + cols, out.to(gate.dtype), mask=ok)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    delta_ptr,
    weight_ptr,
    sum_ptr,
    normed_ptr,
    size,
    eps,
    stride_x_t,
    stride_delta_t,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < size
    x = tl.load(x_ptr + token * stride_x_t + cols, mask=ok, other=0.0)
    delta = tl.load(delta_ptr + token * stride_delta_t + cols, mask=ok, other=0.0)
    total = (x.to(tl.float32) + delta.to(tl.float32)).to(
        x.dtype
    )  # the residual, as torch rounds it
    tl.store(sum_ptr + token * size + cols, total, mask=ok)
    t = total.to(tl.float32)
    scale = 1.0 / tl.sqrt(tl.sum(t * t, 0) / size + eps)
    weight = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(normed_ptr + token * size + cols, (t * scale * weight).to(x.dtype), mask=ok)


@dataclass(frozen=True, slots=True)
class KvWrite:
    """Where `rope_qk` writes a layer's new keys and values: the layer's K and V blocks
    ([num_blocks, block_size, kv_heads, dim] each, contiguous) and each token's slot (its block x
    block_size + offset)."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slots: torch.Tensor

    def check(self, num_tokens: int, num_kv_heads: int, dim: int, qkv: torch.Tensor) -> None:
        k, v = self.k_cache, self.v_cache
        if not (k.is_contiguous() and v.is_contiguous() and k.shape == v.shape):
            raise ValueError("the K and V caches must be contiguous and of one shape")
        if tuple(k.shape[-2:]) != (num_kv_heads, dim) or k.dtype != qkv.dtype:
            raise ValueError(
                f"cache rows of {tuple(k.shape[-2:])} {k.dtype}, not"
                f" {(num_kv_heads, dim)} {qkv.dtype}"
            )
        if self.slots.shape != (num_tokens,):
            raise ValueError(f"{tuple(self.slots.shape)} slots for {num_tokens} tokens")


def rope_qk(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    kv_write: KvWrite | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`apply_rope` of qkv's query and key heads, as (q [tokens, num_heads, head_dim], k [tokens,
    num_kv_heads, head_dim]), each contiguous; with `kv_write`, the same pass also writes each
    token's roped key heads and its value heads (the heads after the key heads) into the cache
    at its slot, as `index_copy_` would.

    qkv [tokens, >= (num_heads + num_kv_heads) * head_dim] with contiguous rows (and the value
    heads after those with `kv_write`); cos / signed_sin [tokens, 1, head_dim] as `rope_tables`
    makes them. head_dim must be a power of two.
    """
    num_tokens, dim = qkv.shape[0], cos.shape[-1]
    if qkv.stride(1) != 1 or cos.stride(-1) != 1 or signed_sin.stride() != cos.stride():
        raise ValueError("rope_qk needs rows with a contiguous last dimension")
    if dim & (dim - 1):
        raise ValueError(f"rope_qk needs a power-of-two head_dim, got {dim}")
    q = torch.empty((num_tokens, num_heads, dim), device=qkv.device, dtype=qkv.dtype)
    k = torch.empty((num_tokens, num_kv_heads, dim), device=qkv.device, dtype=qkv.dtype)
    if not num_tokens:
        return q, k
    num_qk_heads = num_heads + num_kv_heads
    num_read, k_cache, v_cache, slots = num_qk_heads, q, q, q  # the last three unread
    if kv_write is not None:
        kv_write.check(num_tokens, num_kv_heads, dim, qkv)
        num_read += num_kv_heads
        k_cache, v_cache, slots = kv_write.k_cache, kv_write.v_cache, kv_write.slots
    if qkv.shape[1] < num_read * dim or cos.shape[0] < num_tokens:
        raise ValueError(
            f"rope_qk reads {num_read} heads of {dim} values for {num_tokens} tokens: qkv rows"
            f" of {qkv.shape[1]}, rope tables of {cos.shape[0]} rows"
        )
    grid = (num_tokens, triton.cdiv(num_read, _BLOCK_H))
    _rope_kernel[grid](
        qkv,
        cos,
        signed_sin,
        q,
        k,
        k_cache,
        v_cache,
        slots,
        num_heads,
        num_qk_heads,
        qkv.stride(0),
        cos.stride(0),
        DIM=dim,
        BLOCK_H=_BLOCK_H,
        WRITE_KV=kv_write is not None,
    )
    return q, k


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of a fused [tokens, 2 x intermediate] projection: [tokens, intermediate]."""
    num_tokens, size = gate_up.shape[0], gate_up.shape[1] // 2
    if gate_up.stride(1) != 1:
        raise ValueError("silu_mul needs rows with a contiguous last dimension")
    out = torch.empty((num_tokens, size), device=gate_up.device, dtype=gate_up.dtype)
    if num_tokens:
        grid = (num_tokens, triton.cdiv(size, _BLOCK_I))
        _silu_mul_kernel[grid](
            gate_up, out, size, gate_up.stride(0), out.stride(0), BLOCK_I=_BLOCK_I
        )
    return out


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, RMSNorm(x + delta) * weight), both [tokens, hidden] in x's dtype, the norm
    accumulated in float32."""
    num_tokens, size = x.shape
    if x.stride(1) != 1 or delta.stride(1) != 1 or weight.stride(0) != 1:
        raise ValueError("add_rms_norm needs rows with a contiguous last dimension")
    total, normed = torch.empty_like(x), torch.empty_like(x)
    if num_tokens:
        _add_rms_norm_kernel[(num_tokens,)](
            x,
            delta,
            weight,
            total,
            normed,
            size,
            eps,
            x.stride(0),
            delta.stride(0),
            BLOCK=triton.next_power_of_2(size),
            num_warps=8 if size >= 2048 else 4,
        )
    return total, normed
