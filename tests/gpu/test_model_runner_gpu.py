"""Model runner on CUDA: bf16 tracks an fp32 reference, and paging never changes the logits."""

from __future__ import annotations

import random

import pytest
import torch

from kvmesh.workers.model.model_config import ModelConfig, preset
from kvmesh.workers.model.runner import ModelRunner, SeqChunk
from kvmesh.workers.model.weights import random_weights
from tests.gpu.small_model import small_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

NUM_BLOCKS = 256
BLOCK_SIZE = 16


def runner(config: ModelConfig, dtype: torch.dtype) -> ModelRunner:
    weights = random_weights(config, seed=0, device="cuda", dtype=dtype)
    return ModelRunner(config, NUM_BLOCKS, BLOCK_SIZE, device="cuda", dtype=dtype, weights=weights)


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(length)]


def assert_bf16_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    # bf16 keeps 8 mantissa bits: compare shape of the distribution, not digits.
    scale = expected.abs().max().item()
    assert (got - expected).abs().max().item() < 0.08 * scale
    cosine = torch.nn.functional.cosine_similarity(got.flatten(), expected.flatten(), dim=0)
    assert cosine.item() > 0.999


def test_bf16_logits_track_fp32_reference_on_same_weights() -> None:
    config = small_config()
    ids = prompt(300, seed=1)
    table = random.Random(2).sample(range(NUM_BLOCKS), 19)
    reference = runner(config, torch.float32).forward_all_logits([SeqChunk(ids, 0, table)])[0]
    got = runner(config, torch.bfloat16).forward_all_logits([SeqChunk(ids, 0, table)])[0]
    assert got.dtype == torch.float32
    assert_bf16_close(got, reference)


def test_cuda_fp32_matches_cpu_fp32() -> None:
    config = preset("tiny-random")
    ids = [SeqChunk(prompt(50, seed=3), 0, list(range(4)))]
    cpu = ModelRunner(config, NUM_BLOCKS, BLOCK_SIZE).forward(ids)
    cuda = ModelRunner(config, NUM_BLOCKS, BLOCK_SIZE, device="cuda", dtype=torch.float32)
    torch.testing.assert_close(cuda.forward(ids).cpu(), cpu, atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_and_decoded_match_one_shot(dtype: torch.dtype) -> None:
    config = small_config()
    ids = prompt(200, seed=4)
    one_shot = runner(config, dtype)
    expected = one_shot.forward_all_logits([SeqChunk(ids, 0, list(range(13)))])[0]
    paged = runner(config, dtype)
    table = random.Random(5).sample(range(NUM_BLOCKS), 13)
    paged.forward([SeqChunk(ids[:70], 0, table)])
    got = [paged.forward([SeqChunk(ids[70:190], 70, table)])[0]]
    got += [paged.forward([SeqChunk(ids[p : p + 1], p, table)])[0] for p in range(190, 200)]
    rows = expected[[189, *range(190, 200)]]
    if dtype == torch.float32:
        torch.testing.assert_close(torch.stack(got), rows, atol=2e-4, rtol=0)
    else:
        assert_bf16_close(torch.stack(got), rows)


def test_mixed_batch_matches_each_sequence_alone_bf16() -> None:
    config = small_config()
    shapes = [(0, 150), (40, 60), (90, 1), (17, 1), (0, 1)]
    seqs = [prompt(a + b, seed=10 + i) for i, (a, b) in enumerate(shapes)]
    tables = [list(range(16 * i, 16 * i + 16)) for i in range(len(shapes))]
    batched = runner(config, torch.bfloat16)
    expected = []
    for ids, (cached_len, _), table in zip(seqs, shapes, tables, strict=True):
        alone = ModelRunner(
            config,
            NUM_BLOCKS,
            BLOCK_SIZE,
            device="cuda",
            dtype=torch.bfloat16,
            weights=batched.weights,
        )
        if cached_len:
            for r in (alone, batched):
                r.forward([SeqChunk(ids[:cached_len], 0, table)])
        expected.append(alone.forward([SeqChunk(ids[cached_len:], cached_len, table)])[0])
    chunks = [SeqChunk(s[a:], a, t) for s, (a, _), t in zip(seqs, shapes, tables, strict=True)]
    assert_bf16_close(batched.forward(chunks), torch.stack(expected))


def test_llama32_1b_shape_runs_prefill_and_batched_decode() -> None:
    config = preset("llama3.2-1b-random")
    model = ModelRunner(config, 512, BLOCK_SIZE, device="cuda")
    assert model.dtype == torch.bfloat16
    batch = [
        SeqChunk(prompt(500 + i, seed=i), 0, list(range(32 * i, 32 * i + 32))) for i in range(4)
    ]
    assert torch.isfinite(model.forward(batch)).all()
    decode = [SeqChunk([7], 500 + i, list(range(32 * i, 32 * i + 32))) for i in range(4)]
    logits = model.forward(decode)
    assert logits.shape == (4, config.vocab_size) and torch.isfinite(logits).all()


def test_few_row_matmuls_track_the_unfused_layers_in_decode() -> None:
    """A decode step's projections with the norms and SiLU in their epilogues (`skinny_matmul`)
    give the logits of the cuBLAS and elementwise kernels, within bf16's rounding."""
    model = runner(small_config(), torch.bfloat16)
    model.cuda_graphs = False  # both paths eager: the comparison is of the layers alone
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(6)]
    model.forward([SeqChunk(prompt(40, seed=30 + i), 0, t) for i, t in enumerate(tables)])
    step = [SeqChunk([11 + i], 40, t) for i, t in enumerate(tables)]
    fused = model.forward(step)
    model.few_row_matmuls = False
    unfused = model.forward(step)
    assert not torch.equal(fused, unfused)  # two paths ran, rounding apart
    assert_bf16_close(fused, unfused)
