"""RoPE context extension (`linear`, `dynamic`, `yarn`): the runner matches transformers."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from kvmesh.workers.model.model_config import ModelConfig
from kvmesh.workers.model.rope import rope_inv_freq
from kvmesh.workers.model.rope_scaling import (
    DynamicRopeScaling,
    LinearRopeScaling,
    YarnRopeScaling,
)
from kvmesh.workers.model.runner import ModelRunner, SeqChunk
from tests.unit.tiny_llama import tiny_llama_config

NUM_BLOCKS = 32
BLOCK_SIZE = 4


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _hf_model(tmp_path: Path, rope: dict[str, Any], max_position_embeddings: int) -> Any:
    transformers = pytest.importorskip("transformers")
    hf_config = tiny_llama_config(
        transformers,
        max_position_embeddings=max_position_embeddings,
        rope_parameters={"rope_theta": 10000.0, **rope},
        rms_norm_eps=1e-5,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(hf_config).eval()
    model.save_pretrained(tmp_path)
    return model


def _runner(model_dir: Path) -> ModelRunner:
    config = ModelConfig.from_model_dir(str(model_dir))
    return ModelRunner(config, NUM_BLOCKS, BLOCK_SIZE, weights_path=str(model_dir))


def _prompt(length: int) -> list[int]:
    rng = random.Random(3)
    return [rng.randrange(256) for _ in range(length)]


def _check_one_shot_and_chunked(model: Any, runner: ModelRunner, ids: list[int]) -> None:
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0].float()
    table = random.Random(4).sample(range(NUM_BLOCKS), 12)
    whole = runner.forward_all_logits([SeqChunk(ids, 0, table)])[0]
    torch.testing.assert_close(whole, expected, atol=1e-4, rtol=0)
    other = random.Random(5).sample(range(NUM_BLOCKS), 12)
    pieces = [(0, 17), (17, 18), (18, len(ids))]
    got = [runner.forward_all_logits([SeqChunk(ids[a:b], a, other)])[0] for a, b in pieces]
    torch.testing.assert_close(torch.cat(got), expected, atol=1e-4, rtol=0)


def test_linear_scaling_matches_transformers_and_serves_factor_times_the_window(
    tmp_path: Path,
) -> None:
    model = _hf_model(tmp_path, {"rope_type": "linear", "factor": 4.0}, 64)
    runner = _runner(tmp_path)
    assert runner.config.rope_scaling == LinearRopeScaling(4.0)
    assert runner.config.max_position_embeddings == 256
    _check_one_shot_and_chunked(model, runner, _prompt(45))


def test_yarn_matches_transformers_with_its_ramp_and_attention_factor(tmp_path: Path) -> None:
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
    model = _hf_model(tmp_path, rope, 256)
    runner = _runner(tmp_path)
    scaling = runner.config.rope_scaling
    assert isinstance(scaling, YarnRopeScaling)
    assert scaling.attention_factor == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)
    assert runner.config.max_position_embeddings == 1024
    inv_freq, plain = rope_inv_freq(runner.config), 1.0 / 10000.0 ** (torch.arange(0, 16, 2) / 16)
    # The ramp is really exercised: some dimensions kept, some interpolated, some blended.
    assert inv_freq[0] == pytest.approx(plain[0].item())
    assert inv_freq[-1] == pytest.approx(plain[-1].item() / 4.0)
    assert any(p / 4 * 1.01 < f < p * 0.99 for f, p in zip(inv_freq, plain, strict=True))
    _check_one_shot_and_chunked(model, runner, _prompt(45))


def test_dynamic_ntk_matches_transformers_inside_the_window(tmp_path: Path) -> None:
    model = _hf_model(tmp_path, {"rope_type": "dynamic", "factor": 2.0}, 64)
    runner = _runner(tmp_path)
    assert runner.config.rope_scaling == DynamicRopeScaling(2.0, 64)
    assert runner.config.max_position_embeddings == 128
    _check_one_shot_and_chunked(model, runner, _prompt(45))


def test_dynamic_ntk_past_the_window_matches_transformers_decoding_token_by_token(
    tmp_path: Path,
) -> None:
    """Past the window each position has its own base, as in transformers' cached decoding; a
    prefix's keys never depend on what follows, so chunked prefill gives the same logits."""
    transformers = pytest.importorskip("transformers")
    window, prompt_len, total_len = 24, 20, 45
    model = _hf_model(tmp_path, {"rope_type": "dynamic", "factor": 3.0}, window)
    runner = _runner(tmp_path)
    ids = _prompt(total_len)
    expected = []
    with torch.no_grad():
        cache = transformers.DynamicCache(config=model.config)
        out = model(torch.tensor([ids[:prompt_len]]), past_key_values=cache, use_cache=True)
        expected.append(out.logits[0].float())
        for position in range(prompt_len, total_len):
            out = model(
                torch.tensor([[ids[position]]]),
                past_key_values=out.past_key_values,
                position_ids=torch.tensor([[position]]),
                use_cache=True,
            )
            expected.append(out.logits[0].float())
    hf_logits = torch.cat(expected)
    table = random.Random(4).sample(range(NUM_BLOCKS), 12)
    whole = runner.forward_all_logits([SeqChunk(ids, 0, table)])[0]
    torch.testing.assert_close(whole, hf_logits, atol=1e-4, rtol=0)
    # Plain RoPE would differ past the window: the test can fail.
    plain_dir = tmp_path / "plain"
    _hf_model(plain_dir, {"rope_type": "default"}, 128)
    plain = _runner(plain_dir).forward_all_logits([SeqChunk(ids, 0, table)])[0]
    assert not torch.allclose(plain[window:], hf_logits[window:], atol=1e-3)


def test_bad_scaling_parameters_are_refused_with_their_values() -> None:
    base = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 300,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 64,
    }
    with pytest.raises(ValueError, match="factor must be >= 1, got 0.5"):
        ModelConfig.from_hf_dict({**base, "rope_scaling": {"type": "linear", "factor": 0.5}})
    with pytest.raises(ValueError, match="needs a 'factor'"):
        ModelConfig.from_hf_dict({**base, "rope_scaling": {"rope_type": "dynamic"}})
    yarn = {"rope_type": "yarn", "factor": 2.0, "beta_fast": 1.0, "beta_slow": 4.0}
    with pytest.raises(ValueError, match="beta_slow <= beta_fast, got 4.0, 1.0"):
        ModelConfig.from_hf_dict({**base, "rope_scaling": yarn})


def test_scalings_with_equal_numbers_have_different_fingerprints() -> None:
    base = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 300,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 64,
    }
    prints = {
        ModelConfig.from_hf_dict({**base, "rope_scaling": {"type": t, "factor": 2.0}}).fingerprint()
        for t in ("linear", "dynamic", "yarn")
    }
    assert len(prints) == 3
