"""The gate/up matmul with SiLU x up in its epilogue (`gated_matmul`) against float64, and a long
prefill through it against cuBLAS + `silu_mul` in the runner."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from kvmesh.workers.model.runner import ModelRunner, SeqChunk
from kvmesh.workers.model.weights import random_weights
from tests.gpu.small_model import small_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
        reason="needs a Hopper card",
    ),
]


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    gate, up = (x.double() @ w.double().T).chunk(2, dim=-1)
    return gate / (1 + torch.exp(-gate)) * up


@pytest.mark.parametrize(
    ("rows", "k", "n"),
    [(8192, 512, 1024), (300, 136, 200), (4097, 256, 640), (129, 64, 128)],
)
def test_the_epilogue_gives_silu_of_gate_times_up_at_any_shape(rows: int, k: int, n: int) -> None:
    from kvmesh.workers.model import gated_matmul

    assert gated_matmul.usable(torch.device("cuda"))
    gen = torch.Generator(device="cuda").manual_seed(rows + n)
    x = torch.randn(rows, k, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(2 * n, k, device="cuda", generator=gen) / k**0.5).bfloat16()
    got = gated_matmul.silu_gate_matmul(x, w)
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    expected = _reference(x, w)
    scale = expected.abs().max().item()
    # one bf16 rounding of a float32 result: ~2^-8 of the values' scale
    assert (got.double() - expected).abs().max().item() < 8e-3 * scale
    # every row and column written (tails of the tiles included): no NaN, no stale zeros
    assert torch.isfinite(got).all()
    assert (got.double() - expected).abs().amax(dim=1).max().item() < 8e-3 * scale


def test_a_weight_that_is_no_gate_up_pair_is_refused_and_a_strided_input_is_read() -> None:
    from kvmesh.workers.model import gated_matmul

    x = torch.randn(16, 64, device="cuda").bfloat16()
    with pytest.raises(ValueError, match="gate/up pair"):
        gated_matmul.silu_gate_matmul(x, torch.zeros(33, 64, device="cuda", dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="multiple of 8"):
        gated_matmul.silu_gate_matmul(x[:, :60], torch.zeros(32, 60, device="cuda").bfloat16())
    w = torch.randn(64, 64, device="cuda").bfloat16()
    strided = x.T.contiguous().T  # column-major: copied to rows first
    assert not strided.is_contiguous()
    torch.testing.assert_close(
        gated_matmul.silu_gate_matmul(strided, w), gated_matmul.silu_gate_matmul(x, w)
    )


def test_a_long_prefill_through_the_epilogue_gives_the_logits_of_the_two_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvmesh.workers.model import gated_matmul

    config = dataclasses.replace(small_config(), max_position_embeddings=8192)
    weights = random_weights(config, seed=0, device="cuda", dtype=torch.bfloat16)
    model = ModelRunner(config, 600, 16, device="cuda", dtype=torch.bfloat16, weights=weights)
    assert model.gated_matmul
    calls: list[int] = []
    kernel = gated_matmul.silu_gate_matmul

    def counted(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return kernel(x, w)

    monkeypatch.setattr(gated_matmul, "silu_gate_matmul", counted)
    rng = random.Random(3)
    ids = [rng.randrange(256) for _ in range(gated_matmul.MIN_ROWS + 100)]
    table = list(range(-(-len(ids) // 16)))
    fused = model.forward([SeqChunk(ids, 0, table)])
    assert calls == [len(ids)] * config.num_layers
    model.gated_matmul = False
    apart = model.forward([SeqChunk(ids, 0, table)])
    assert len(calls) == config.num_layers  # the second forward took cuBLAS + silu_mul
    assert not torch.equal(fused, apart)  # two paths ran, rounding apart
    scale = apart.abs().max().item()
    assert (fused - apart).abs().max().item() < 0.08 * scale
    cosine = torch.nn.functional.cosine_similarity(fused.flatten(), apart.flatten(), dim=0)
    assert cosine.item() > 0.999
    # a short chunk keeps cuBLAS + silu_mul
    model.gated_matmul = True
    model.forward([SeqChunk(ids[:300], 0, table)])
    assert len(calls) == config.num_layers
