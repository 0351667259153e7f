"""The few-row matmuls equal the products they replace, against float64: x @ w^T, the residual
add with the next norm's input, RMSNorm(t) x g @ w^T from it, and SiLU(gate) x up.

On a GPU machine as part of tests/gpu; on CPU under Triton's interpreter with
`TRITON_INTERPRET=1 KVMESH_KERNEL_DEVICE=cpu` (float32 only, as the elementwise kernels' tests)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

DEVICE = os.environ.get("KVMESH_KERNEL_DEVICE", "cuda")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs CUDA (or the interpreter)"
    ),
]


def dtypes() -> list[torch.dtype]:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return [torch.float32]  # the interpreter's bfloat16 conversions do not round like the GPU's
    return [torch.float32, torch.bfloat16]


def assert_near(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """Within a few roundings of the dtype (tf32 products for float32 on a GPU) of the float64
    result, relative to its largest value."""
    scale = want.abs().max().item()
    bound = 4e-3 if dtype == torch.float32 else 2e-2
    error = (got.double() - want).abs().max().item()
    assert error <= bound * scale, (error, scale)


def case(rows: int, n: int, k: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen)
    delta = torch.randn(rows, k, generator=gen)
    g = 1 + 0.1 * torch.randn(k, generator=gen)
    w = torch.randn(n, k, generator=gen) / k**0.5
    return tuple(t.to(DEVICE, dtype) for t in (x, delta, g, w))


@pytest.mark.parametrize("dtype", dtypes())
@pytest.mark.parametrize("rows", [1, 7, 32, 64])
def test_skinny_matmul_equals_the_product(dtype: torch.dtype, rows: int) -> None:
    from kvmesh.workers.model.skinny_matmul import MatmulTile, skinny_matmul

    x, _, _, w = case(rows, 80, 512, dtype, rows)  # 80 columns: the last 32-column block partial
    got = skinny_matmul(x, w, MatmulTile(32, 128, 4, 3))
    assert got.shape == (rows, 80) and got.dtype == dtype
    assert_near(got, x.double() @ w.double().T, dtype)


def rms_normed(total: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    t = total.double()
    return t / (t.pow(2).mean(-1, keepdim=True) + eps).sqrt() * g.double()


@pytest.mark.parametrize("dtype", dtypes())
@pytest.mark.parametrize("rows", [3, 32])
def test_add_matmul_adds_the_residual_and_prepares_the_norm(dtype: torch.dtype, rows: int) -> None:
    from kvmesh.workers.model.skinny_matmul import MatmulTile, add_matmul

    x, _, _, w = case(rows, 96, 512, dtype, 10 + rows)  # 96 columns: three 32-column blocks
    residual, _, g, _ = case(rows, 96, 96, dtype, 20 + rows)
    total, normed = add_matmul(x, w, residual, g, MatmulTile(32, 128, 4, 3))
    assert total.shape == (rows, 96) and total.dtype == dtype
    assert_near(total, residual.double() + x.double() @ w.double().T, dtype)
    # The next norm's input is exactly what its definition says of the sum the call returned.
    torch.testing.assert_close(normed.scaled, (total.float() * g.float()).to(dtype), atol=0, rtol=0)
    assert normed.squares.shape == (3, 16 if rows <= 16 else 32)
    squares = normed.squares.sum(0)
    torch.testing.assert_close(squares[:rows], total.float().pow(2).sum(-1), rtol=1e-5, atol=0)
    assert not squares[rows:].any()  # padding rows add nothing


@pytest.mark.parametrize("dtype", dtypes())
@pytest.mark.parametrize("rows", [1, 32])
def test_norm_matmul_after_add_matmul_equals_add_norm_then_product(
    dtype: torch.dtype, rows: int
) -> None:
    from kvmesh.workers.model.skinny_matmul import MatmulTile, add_matmul, norm_matmul

    x, _, _, w_o = case(rows, 256, 512, dtype, rows)
    residual, _, g, w = case(rows, 160, 256, dtype, 5 + rows)
    eps = 1e-5
    total, normed = add_matmul(x, w_o, residual, g, MatmulTile(32, 128, 4, 3))
    got = norm_matmul(normed, eps, w, tile=MatmulTile(32, 128, 4, 3))
    assert got.shape == (rows, 160)
    assert_near(got, rms_normed(total, g, eps) @ w.double().T, dtype)


@pytest.mark.parametrize("dtype", dtypes())
def test_norm_matmul_with_silu_equals_silu_of_gate_times_up(dtype: torch.dtype) -> None:
    from kvmesh.workers.model.skinny_matmul import MatmulTile, norm_input, norm_matmul

    rows, size = 32, 48  # the last 32-column block of gate and of up partial
    t, _, g, w = case(rows, 2 * size, 256, dtype, 7)
    got = norm_matmul(norm_input(t, g), 1e-6, w, silu=True, tile=MatmulTile(32, 128, 4, 2))
    gate_up = rms_normed(t, g, 1e-6) @ w.double().T
    want = F.silu(gate_up[:, :size]) * gate_up[:, size:]
    assert got.shape == (rows, size)
    assert_near(got, want, dtype)


def test_few_row_matmuls_refuse_what_they_cannot_take() -> None:
    from kvmesh.workers.model.skinny_matmul import (
        MAX_ROWS,
        MatmulTile,
        add_matmul,
        norm_input,
        norm_matmul,
        skinny_matmul,
    )

    x, _, g, w = case(4, 64, 256, torch.float32, 1)
    with pytest.raises(ValueError, match="rows"):
        skinny_matmul(torch.zeros(MAX_ROWS + 1, 256, device=DEVICE), w)
    with pytest.raises(ValueError, match="block_k"):
        skinny_matmul(x[:, :200], w[:, :200].contiguous(), MatmulTile(32, 128, 4, 2))
    with pytest.raises(ValueError, match="even N"):
        norm_matmul(norm_input(x, g), 1e-6, w[:63], silu=True)
    with pytest.raises(ValueError, match="partial sums"):
        norm_matmul(norm_input(x, g)._replace(squares=torch.zeros(1, 32)), 1e-6, w)
    with pytest.raises(ValueError, match="residual"):
        add_matmul(x, w, x, g[:64])
    with pytest.raises(ValueError, match="norm weight"):
        add_matmul(x, w, x[:, :64].contiguous(), g)
    with pytest.raises(ValueError, match="power of two"):
        MatmulTile(24, 128, 4, 2)


@pytest.mark.parametrize("dtype", dtypes())
def test_few_row_layers_equal_the_unfused_layers(dtype: torch.dtype) -> None:
    """`LayerStack.run_few_rows` wires each norm to the projection it feeds (the next layer's
    input norm, the final norm after the last) as `run` does: same hidden states, rounding apart."""
    from kvmesh.workers.model import skinny_matmul
    from kvmesh.workers.model.layer_stack import LayerStack
    from kvmesh.workers.model.model_config import preset
    from kvmesh.workers.model.weights import random_weights

    config = preset("tiny-random")  # hidden 64, intermediate 128: K multiples of 16
    weights = random_weights(config, seed=3, device=DEVICE, dtype=dtype, std=0.1)
    gen = torch.Generator().manual_seed(4)
    for layer in weights.layers:  # norm scales that differ, so a norm wired wrong shows
        for g in (layer.input_norm, layer.post_attention_norm):
            g.copy_(0.5 + torch.rand(g.shape, generator=gen))
    weights.norm.copy_(0.5 + torch.rand(weights.norm.shape, generator=gen))
    q_size = config.num_heads * config.head_dim

    def attend(layer_index: int, qkv: torch.Tensor) -> torch.Tensor:
        return torch.tanh(qkv[:, :q_size] * (1 + layer_index))  # any function of qkv

    x = torch.randn(5, config.hidden_size, generator=gen).to(DEVICE, dtype)
    stack = LayerStack(weights, config.rms_norm_eps, few_rows=skinny_matmul)
    want = stack.run(x, attend, fused=False)
    got = stack.run_few_rows(x, attend)
    assert got.shape == want.shape
    assert_near(got, want.double(), dtype)
    assert_near(stack.logits(got, few_rows=True), stack.logits(want).double(), dtype)
