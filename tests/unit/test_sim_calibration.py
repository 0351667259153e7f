"""The simulator's cost model derived from a deployment's own calibration block."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvmesh.coordinator.sim.calibration import (
    BatchedHits,
    DecodeTiming,
    DeploymentCalibration,
    PromptTiming,
    StreamEnd,
    calibrated_fields,
    pairs,
)
from kvmesh.coordinator.sim.cost_model import SimCostModel

BASE = SimCostModel(
    attention_per_token_pair_ms=1e-6,
    decode_fixed_ms=6.0,
    decode_per_seq_ms=0.02,
    decode_per_context_token_ms=4e-5,
)
CONTEXT = 8192 + 256 + 16  # the decode phase's prompt and half its 32 tokens


def _decode(batch: int, step_ms: float, client_gap_ms: float) -> DecodeTiming:
    return DecodeTiming(batch, 2 * batch, CONTEXT, step_ms, client_gap_ms, client_gap_ms + 0.4)


def calibration(cold_prefill_ms: float = 217.394432) -> DeploymentCalibration:
    """256 new behind 8,192 cached, an 8,448-token cold prompt, a step of 7 + 0.5 ms a sequence;
    the cold prefill is what 0.02 ms a token and BASE's attention give over the hit's."""
    return DeploymentCalibration(
        num_workers=2,
        hit=PromptTiming(256, 8192, 40.0, 30.0, 2.0, 20.0),
        cold=PromptTiming(8448, 0, 250.0, 240.0, 2.0, cold_prefill_ms),
        decode=(
            _decode(1, 7.5, 7.0),  # the client keeps up at 1 and 4 sequences a worker
            _decode(4, 9.0, 8.0),
            _decode(8, 11.0, 12.0),  # and not at 8 and 16: delivery sets the pace
            _decode(16, 15.0, 24.0),
        ),
        stream_end=StreamEnd(8, 7.6, 10.6, 7.4, 7.5),
    )


def test_calibration_derives_each_term_as_documented() -> None:
    fit = calibrated_fields(calibration(), BASE)
    f = fit.fields
    # (217.39 - 20 - 1e-6 x (8448 x 4224 - 256 x 8320)) / 8192: the cold prompt's 8,192 more tokens
    assert f["prefill_per_token_ms"] == pytest.approx(0.02)
    # the step's line 7 + 0.5 b over BASE's GPU terms at 8,464 tokens a sequence
    assert f["decode_fixed_ms"] == BASE.decode_fixed_ms
    assert f["host_step_fixed_ms"] == pytest.approx(1.0)
    assert f["host_step_per_seq_ms"] == pytest.approx(0.5 - 0.02 - CONTEXT * 4e-5)
    # the hit's measured prefill less the step's host time, its tokens and its attention
    host_1 = 1.0 + 0.5 - 0.02 - CONTEXT * 4e-5
    assert f["prefill_fixed_ms"] == pytest.approx(20.0 - host_1 - 256 * 0.02 - 256 * 8320 * 1e-6)
    # through 0 over the paced batches: (16 x 12 + 32 x 24) / (16^2 + 32^2)
    assert f["delivery_per_stream_ms"] == pytest.approx(0.75)
    assert f["delivery_fixed_ms"] == 0.0
    assert f["service_latency_ms"] == pytest.approx(40.0 - 20.0 - 0.75)
    assert f["stream_end_ms"] == pytest.approx(3.0)
    assert fit.notes == ()


def test_the_derived_model_prices_the_hit_and_the_step_as_measured() -> None:
    model = SimCostModel.from_mapping(calibrated_fields(calibration(), BASE).fields, BASE)
    hit_ttft = model.chunk_step_ms(256, 8192, 0, 0) + model.delivery_ms(1)
    assert hit_ttft + model.service_latency_ms == pytest.approx(40.0)
    for batch, step_ms in ((1, 7.5), (4, 9.0), (8, 11.0), (16, 15.0)):
        assert model.decode_step_ms(batch, batch * CONTEXT) == pytest.approx(step_ms)


def test_a_gpu_term_above_the_measured_step_is_lowered_to_it() -> None:
    heavy = SimCostModel.from_mapping({"decode_fixed_ms": 9.0, "decode_per_seq_ms": 0.6}, BASE)
    fit = calibrated_fields(calibration(), heavy)
    assert fit.fields["decode_fixed_ms"] == pytest.approx(7.0)
    assert fit.fields["host_step_fixed_ms"] == 0.0
    assert fit.fields["decode_per_context_token_ms"] == 0.0
    assert fit.fields["decode_per_seq_ms"] == pytest.approx(0.5)
    assert fit.fields["host_step_per_seq_ms"] == 0.0
    assert len(fit.notes) == 2
    model = SimCostModel.from_mapping(fit.fields, heavy)
    assert model.decode_step_ms(16, 16 * CONTEXT) == pytest.approx(15.0)


def test_a_cold_prompt_no_slower_than_its_attention_is_refused() -> None:
    with pytest.raises(ValueError, match="not longer than the hit"):
        calibrated_fields(calibration(cold_prefill_ms=50.0), BASE)


def test_the_block_round_trips_through_the_report_and_refuses_a_partial_one() -> None:
    block = calibration().as_dict() | {"trials": {"client": {}}, "wall_s": 12.0}
    assert DeploymentCalibration.from_mapping(block) == calibration()
    with pytest.raises(ValueError, match="not a calibration block"):
        DeploymentCalibration.from_mapping({k: v for k, v in block.items() if k != "decode"})
    one_batch = block | {"decode": block["decode"][:1]}
    with pytest.raises(ValueError, match="two batch sizes"):
        DeploymentCalibration.from_mapping(one_batch)


def test_the_checks_set_each_measured_figure_beside_the_derived_one() -> None:
    checks = calibrated_fields(calibration(), BASE).checks
    assert checks["worker_step_ms_b16"] == 15.0
    assert checks["worker_step_ms_b16_derived"] == pytest.approx(15.0)  # on the line
    assert checks["client_gap_ms_b16_derived"] == pytest.approx(32 * 0.75)  # delivery paces
    assert checks["client_gap_ms_b1_derived"] == pytest.approx(7.5)  # the step paces
    # the cold prompt: its prefill step + delivery + what the hit spent outside the worker
    assert checks["cold_client_ttft_ms_derived"] == pytest.approx(217.394432 + 0.75 + 19.25)


def test_a_gap_within_the_margin_of_the_step_is_not_delivery() -> None:
    # Two streams, a gap 1 % over the step: timing noise, not a paced way to the client (read as
    # paced it would price every stream's token at 8.55 / 2 ms).
    base = calibration()
    kept_up = replace(base, decode=(_decode(1, 8.45, 8.55), _decode(4, 11.24, 11.18)))
    assert calibrated_fields(kept_up, BASE).fields["delivery_per_stream_ms"] == 0.0


def test_hits_batched_in_one_step_price_the_pairs_over_cached_keys() -> None:
    """Hits timed together give the marginal hit; with the cold prompt it fixes the prefill's
    rate per token and what a pair over cached keys costs. Built from a known model (0.018 ms a
    token, cached pairs 2.5x a fresh one), the fit recovers it, and prices each batch's step as
    measured."""
    a, per_token, factor = BASE.attention_per_token_pair_ms, 0.018, 2.5
    host_per_seq = calibrated_fields(calibration(), BASE).fields["host_step_per_seq_ms"]
    hit_ms = 256 * per_token + a * pairs(256, 8192, factor)
    cold_prefill = (
        20.0 + (8448 - 256) * per_token + a * pairs(8448, 0) - a * pairs(256, 8192, factor)
    )
    steps = [BatchedHits(b, 20.0 + (b - 1) * (hit_ms + host_per_seq)) for b in (1, 4, 8)]
    measured = replace(calibration(cold_prefill), batched=tuple(steps))
    fit = calibrated_fields(measured, BASE)
    assert fit.fields["prefill_per_token_ms"] == pytest.approx(per_token)
    assert fit.fields["cached_attention_factor"] == pytest.approx(factor)
    for b in steps:
        assert fit.checks[f"hits_step_ms_b{b.batch}_derived"] == pytest.approx(b.worker_prefill_ms)
    # the block's round trip keeps them
    assert DeploymentCalibration.from_mapping(measured.as_dict()).batched == measured.batched


def test_batched_hits_that_did_not_queue_are_not_used() -> None:
    # A step that gets shorter with more hits: they ran apart, not in one step behind the cold
    # prompt; the fit keeps the rate of the cold prompt and the hit alone, and says why.
    steps = (BatchedHits(1, 20.0), BatchedHits(4, 15.0), BatchedHits(8, 12.0))
    fit = calibrated_fields(replace(calibration(), batched=steps), BASE)
    assert fit.fields["prefill_per_token_ms"] == pytest.approx(0.02)
    assert fit.fields["cached_attention_factor"] == BASE.cached_attention_factor
    assert any("not used" in note for note in fit.notes)
