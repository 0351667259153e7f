"""The sampler: safe parameter ranges, numerically safe at their edges, one row never another's."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.workers.contract.replies import SequenceFailure
from kvmesh.workers.contract.requests import MAX_TEMPERATURE, MIN_TEMPERATURE, SamplingConfig
from kvmesh.workers.engine.sampler import draw, sample, sample_isolated


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


def test_draws_follow_the_tempered_softmax() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    cfgs = [SamplingConfig(temperature=0.7, seed=s) for s in range(3000)]
    drawn = [sample(logits, [cfg], [0])[0] for cfg in cfgs]
    expected = torch.softmax(logits[0] / 0.7, dim=0)
    for token in range(6):
        share = drawn.count(token) / len(drawn)
        assert abs(share - expected[token].item()) < 0.03, (token, share)


@pytest.mark.parametrize(
    ("cut", "kept"), [({"top_k": 2}, {0, 1}), ({"top_p": 0.6}, {0, 1}), ({"top_p": 0.9}, {0, 1, 2})]
)
def test_top_k_and_top_p_keep_only_the_most_likely(cut: dict[str, float], kept: set[int]) -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    drawn = {
        sample(logits, [SamplingConfig(temperature=1.0, seed=s, **cut)], [0])[0]  # type: ignore[arg-type]
        for s in range(300)
    }
    assert drawn == kept


def test_a_rows_token_is_fixed_by_its_seed_and_position_not_its_batch() -> None:
    logits = torch.randn(4, 320, generator=torch.Generator().manual_seed(1))
    cfgs = [
        SamplingConfig(temperature=0.9, seed=11),
        SamplingConfig(),  # greedy
        SamplingConfig(temperature=1.3, top_k=40, min_p=0.05, seed=12),
        SamplingConfig(temperature=0.6, top_p=0.8, seed=13),
    ]
    together = sample(logits, cfgs, [5, 6, 7, 8])
    alone = [sample(logits[i : i + 1], [cfgs[i]], [5 + i])[0] for i in range(4)]
    assert together == alone
    again = sample(logits.flip(0), cfgs[::-1], [8, 7, 6, 5])
    assert again == together[::-1]
    later = [sample(logits[:1], [cfgs[0]], [p])[0] for p in range(5, 45)]
    assert len(set(later)) > 5  # each position draws afresh


def test_the_uniform_of_a_seed_and_position_is_pinned() -> None:
    # A change here changes every seeded request's tokens (and what a replay on another worker
    # draws): it must be deliberate.
    from kvmesh.workers.engine.sampler import draw_uniform

    assert draw_uniform(0, 0) == pytest.approx(0.6524484863740323, abs=0)
    assert draw_uniform(7, 5) == pytest.approx(0.5341697098600662, abs=0)
    assert 0.0 < draw_uniform(2**64 - 1, 3) < 1.0


def test_draw_gives_samples_tokens_and_flags_a_bad_drawn_row_without_raising() -> None:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 50, generator=gen)
    configs = [
        SamplingConfig(temperature=0.9, seed=1),
        SamplingConfig(),
        SamplingConfig(temperature=1.1, top_k=5, seed=2),
        SamplingConfig(temperature=0.5, top_p=0.8, seed=3),
    ]
    positions = [7, 8, 9, 10]
    tokens, failed = draw(logits, configs, positions)
    assert tokens.tolist() == sample(logits, configs, positions)
    assert failed is not None and not failed.any()
    logits[0, 3] = float("nan")  # a drawn row
    logits[1, 4] = float("nan")  # a greedy row: never checked, never failed
    tokens, failed = draw(logits, configs, positions)
    assert failed is not None and failed.tolist() == [True, False, False, False]
    assert tokens[2:].tolist() == sample(logits[2:], configs[2:], positions[2:])
    with pytest.raises(FloatingPointError):
        sample(logits, configs, positions)


def test_draw_over_greedy_rows_alone_makes_no_failure_flags() -> None:
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(4))
    tokens, failed = draw(logits, [SamplingConfig()] * 3, [1, 2, 3])
    assert failed is None
    assert tokens.tolist() == logits.argmax(dim=-1).tolist()
