"""The sampler: safe parameter ranges, numerically safe at their edges, one row never another's."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.workers.contract.replies import SequenceFailure
from kvmesh.workers.contract.requests import MAX_TEMPERATURE, MIN_TEMPERATURE, SamplingConfig
from kvmesh.workers.engine.sampler import sample, sample_isolated


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": 1e-30},
        {"temperature": -1.0},
        {"temperature": math.nan},
        {"temperature": math.inf},
        {"temperature": 101.0},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_p": math.nan},
        {"top_k": -1},
        {"min_p": -0.1},
        {"min_p": math.nan},
        {"min_p": 2.0},
        {"seed": -1},
        {"max_tokens": 0},
    ],
)
def test_unsafe_parameters_are_refused_with_their_numbers(fields: dict[str, float]) -> None:
    name = next(iter(fields))
    with pytest.raises(ValueError, match=name):
        SamplingConfig(**fields)  # type: ignore[arg-type]


def test_the_edges_of_the_safe_ranges_sample_finite_tokens() -> None:
    logits = torch.tensor([[30.0, -30.0, 29.9, 0.0] * 80])
    for t in (MIN_TEMPERATURE, MAX_TEMPERATURE):
        for extra in ({}, {"top_p": 1e-6}, {"top_k": 1}, {"min_p": 1.0}, {"min_p": 1e-9}):
            cfg = SamplingConfig(temperature=t, seed=7, **extra)  # type: ignore[arg-type]
            (token,) = sample(logits, [cfg], [5])
            assert 0 <= token < logits.shape[1]


def test_min_p_keeps_only_tokens_near_the_most_likely() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    cfg = SamplingConfig(temperature=1.0, min_p=0.5)
    drawn = {
        sample(logits, [SamplingConfig(**{**_fields(cfg), "seed": s})], [0])[0] for s in range(200)
    }
    assert drawn == {0, 1}  # 0.15 and 0.05 are below 0.5 * 0.5


def _fields(cfg: SamplingConfig) -> dict[str, object]:
    return {name: getattr(cfg, name) for name in SamplingConfig.__slots__}  # type: ignore[attr-defined]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    temperature=st.one_of(st.just(0.0), st.floats(MIN_TEMPERATURE, MAX_TEMPERATURE)),
    top_p=st.floats(0.0, 1.0, exclude_min=True),
    top_k=st.integers(0, 400),
    min_p=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**64 - 1),
    scale=st.sampled_from([1e-3, 1.0, 1e3, 1e30]),
)
def test_any_valid_parameters_sample_a_token_on_any_finite_logits(
    temperature: float, top_p: float, top_k: int, min_p: float, seed: int, scale: float
) -> None:
    logits = torch.randn(1, 320, generator=torch.Generator().manual_seed(seed % 1000)) * scale
    cfg = SamplingConfig(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed)
    (token,) = sample_isolated(logits, [cfg], [3])
    assert isinstance(token, int) and 0 <= token < 320


def test_a_row_of_nan_logits_fails_alone_as_internal() -> None:
    logits = torch.randn(3, 320, generator=torch.Generator().manual_seed(0))
    logits[1] = math.nan
    cfgs = [SamplingConfig(temperature=0.7, seed=s) for s in range(3)]
    out = sample_isolated(logits, cfgs, [4, 4, 4])
    assert isinstance(out[1], SequenceFailure) and out[1].internal
    assert [out[0], out[2]] == [sample(logits[i : i + 1], [cfgs[i]], [4])[0] for i in (0, 2)]
