"""The fused elementwise kernels equal the torch expressions they replace (RoPE and the K/V
write, SiLU x up, add + RMSNorm).

On a GPU machine as part of tests/gpu; on CPU under Triton's interpreter with
`TRITON_INTERPRET=1 KVMESH_KERNEL_DEVICE=cpu` (float32 only: the interpreter's bfloat16
conversions do not round like the GPU's, 1-2 ulp apart)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F

from kvmesh.workers.model.model_config import preset
from kvmesh.workers.model.rope import Rope, apply_rope

DEVICE = os.environ.get("KVMESH_KERNEL_DEVICE", "cuda")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs CUDA (or the interpreter)"
    ),
]


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    if dtype != torch.float32 and os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter's bfloat16 conversions do not round like the GPU's")
    # One float32 multiply-add may round differently (fused or not): about one ulp of the dtype
    # at the values' scale (inputs here are ~N(0, 1)), also where a sum cancels to near zero.
    return {"atol": 1e-6, "rtol": 2e-6} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 8e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_rope_qk_equals_apply_rope(dtype: torch.dtype, num_tokens: int) -> None:
    from kvmesh.workers.model.elementwise_kernels import rope_qk

    within = tolerance(dtype)
    config = preset("tiny-random")
    heads, kv_heads, dim = 12, 4, 64  # 16 q + k heads: two head blocks, the second partial
    gen = torch.Generator().manual_seed(num_tokens)
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(DEVICE, dtype)
    positions = torch.randint(0, 4000, (num_tokens,), generator=gen).to(DEVICE)
    rope = Rope(dataclasses.replace(config, head_dim=dim), torch.device(DEVICE))
    cos, sin = rope.tables(positions, dtype)
    got_q, got_k = rope_qk(qkv, cos, sin, heads, kv_heads)
    want = apply_rope(qkv[:, : (heads + kv_heads) * dim].view(num_tokens, -1, dim), cos, sin)
    assert got_q.is_contiguous() and got_k.is_contiguous() and got_q.dtype == dtype
    assert got_q.shape == (num_tokens, heads, dim) and got_k.shape == (num_tokens, kv_heads, dim)
    torch.testing.assert_close(got_q, want[:, :heads], **within)
    torch.testing.assert_close(got_k, want[:, heads:], **within)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_rope_qk_writes_the_keys_and_values_index_copy_writes(
    dtype: torch.dtype, num_tokens: int
) -> None:
    from kvmesh.workers.model.elementwise_kernels import KvWrite, rope_qk

    config = preset("tiny-random")
    heads, kv_heads, dim, block_size = 12, 4, 64, 16  # q, k, v heads span three head blocks
    gen = torch.Generator().manual_seed(num_tokens)
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(DEVICE, dtype)
    positions = torch.randint(0, 4000, (num_tokens,), generator=gen).to(DEVICE)
    cos, sin = Rope(dataclasses.replace(config, head_dim=dim), torch.device(DEVICE)).tables(
        positions, dtype
    )
    cache = torch.randn(2, 40, block_size, kv_heads, dim, generator=gen).to(DEVICE, dtype)
    slots = torch.randperm(40 * block_size, generator=gen)[:num_tokens].to(DEVICE)
    want_cache = cache.clone()
    want_q, want_k = rope_qk(qkv, cos, sin, heads, kv_heads)
    v = qkv[:, (heads + kv_heads) * dim :].view(num_tokens, kv_heads, dim)
    want_cache[0].view(-1, kv_heads, dim).index_copy_(0, slots, want_k)
    want_cache[1].view(-1, kv_heads, dim).index_copy_(0, slots, v)
    got_q, got_k = rope_qk(qkv, cos, sin, heads, kv_heads, KvWrite(cache[0], cache[1], slots))
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(cache, want_cache)  # the slots written exactly, every other row untouched


def test_a_kv_write_refuses_a_cache_it_would_misread() -> None:
    from kvmesh.workers.model.elementwise_kernels import KvWrite, rope_qk

    config = preset("tiny-random")
    qkv = torch.randn(3, 20 * 64).to(DEVICE)
    positions = torch.arange(3).to(DEVICE)
    cos, sin = Rope(dataclasses.replace(config, head_dim=64), torch.device(DEVICE)).tables(
        positions, torch.float32
    )
    cache = torch.zeros(2, 4, 16, 4, 64).to(DEVICE)
    with pytest.raises(ValueError, match="slots"):
        rope_qk(qkv, cos, sin, 12, 4, KvWrite(cache[0], cache[1], torch.arange(2).to(DEVICE)))
    with pytest.raises(ValueError, match="contiguous"):
        strided = cache.transpose(1, 2)
        rope_qk(qkv, cos, sin, 12, 4, KvWrite(strided[0], strided[1], torch.arange(3).to(DEVICE)))
    with pytest.raises(ValueError, match="qkv rows"):  # no room for the value heads
        narrow = qkv[:, : 16 * 64]
        rope_qk(narrow, cos, sin, 12, 4, KvWrite(cache[0], cache[1], torch.arange(3).to(DEVICE)))
    with pytest.raises(ValueError, match="rope tables"):
        rope_qk(qkv, cos[:2], sin[:2], 12, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (5, 1000), (64, 2304)])
def test_silu_mul_equals_torch(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    from kvmesh.workers.model.elementwise_kernels import silu_mul

    within = tolerance(dtype)
    tokens, size = shape
    gen = torch.Generator().manual_seed(size)
    gate_up = (4 * torch.randn(tokens, 2 * size, generator=gen)).to(DEVICE, dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(silu_mul(gate_up), F.silu(gate) * up, **within)


def test_rows_with_a_stride_are_read_through_it() -> None:
    from kvmesh.workers.model.elementwise_kernels import silu_mul

    wide = torch.randn(6, 300).to(DEVICE)
    gate_up = wide[:, :200]  # rows 300 apart, 200 wide
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(silu_mul(gate_up), F.silu(gate) * up, **tolerance(torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (9, 1000), (33, 4096)])
def test_add_rms_norm_equals_torch(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    from kvmesh.workers.model.elementwise_kernels import add_rms_norm

    within = tolerance(dtype)
    tokens, size = shape
    gen = torch.Generator().manual_seed(size + tokens)
    x, delta = (torch.randn(tokens, size, generator=gen).to(DEVICE, dtype) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(size, generator=gen)).to(DEVICE, dtype)
    total, normed = add_rms_norm(x, delta, weight, 1e-5)
    want_total = x + delta
    torch.testing.assert_close(total, want_total, atol=0.0, rtol=0.0)
    want = F.rms_norm(want_total, weight.shape, weight, 1e-5)
    torch.testing.assert_close(normed, want, **within)
