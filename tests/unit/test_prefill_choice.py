"""The start-up probe that keeps the faster path for long chunked prefills (`prefill_choice`)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from kvmesh.workers.model import batch_plan, prefill_choice
from kvmesh.workers.model.batch_plan import AttentionMode, SeqChunk
from kvmesh.workers.model.model_config import preset
from kvmesh.workers.model.prefill_choice import (
    PrefillChoice,
    apply_faster_prefill,
    choose_prefill,
    probe_chunk,
)
from kvmesh.workers.model.runner import ModelRunner

SPLIT_ON = AttentionMode(
    paged_decode=True, paged_prefill=True, explicit_masks=False, bucketed_prefill=True
)


def test_the_split_is_taken_only_when_it_is_clearly_faster() -> None:
    assert PrefillChoice(512, 7680, split_ms=19.0, paged_ms=21.5).split
    assert not PrefillChoice(512, 7680, split_ms=19.8, paged_ms=20.0).split  # within the margin
    slower = PrefillChoice(512, 7680, split_ms=34.0, paged_ms=27.0)
    assert not slower.split
    assert slower.applied_to(SPLIT_ON) == AttentionMode(
        paged_decode=True, paged_prefill=True, explicit_masks=False, bucketed_prefill=False
    )
    assert "paged kernel" in slower.describe() and "34.00" in slower.describe()


def test_the_probe_chunk_fits_the_pool_and_the_model() -> None:
    chunk = probe_chunk(num_blocks=4096, block_size=16, max_positions=131_072)
    assert chunk is not None
    assert (len(chunk.token_ids), chunk.start_pos) == (512, 7680)
    table = list(chunk.block_table)
    assert len(table) == len(set(table)) == 512 and all(0 <= b < 4096 for b in table)
    assert table != sorted(table)  # scattered, as a serving pool's tables are
    short_pool = probe_chunk(num_blocks=300, block_size=16, max_positions=131_072)
    assert short_pool is not None and short_pool.start_pos == 300 * 16 - 512
    assert probe_chunk(num_blocks=4096, block_size=16, max_positions=2048) is None
    assert probe_chunk(num_blocks=150, block_size=16, max_positions=131_072) is None


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0


def test_choose_times_both_paths_in_turn_and_restores_the_mode() -> None:
    """Each forward costs what the mode it runs under costs; the first round is not counted."""
    clock = FakeClock()
    mode = SPLIT_ON
    seen: list[bool] = []

    def set_mode(m: AttentionMode) -> None:
        nonlocal mode
        mode = m

    heats = 0

    def forward(batch: Sequence[SeqChunk]) -> None:
        nonlocal heats
        if batch[0] is heat:  # untimed: whatever it costs is not counted
            heats += 1
            clock.now += 5.0
            return
        seen.append(mode.bucketed_prefill)
        first = len(seen) <= 2
        clock.now += 1.0 if first else (0.034 if mode.bucketed_prefill else 0.027)

    chunk = SeqChunk([0] * 512, 7680, list(range(512)))
    heat = SeqChunk([0] * 2048, 0, list(range(128)))
    choice = choose_prefill(
        forward, SPLIT_ON, set_mode, chunk, lambda: None, lambda: clock.now, heat=heat
    )
    assert (choice.split_ms, choice.paged_ms) == pytest.approx((34.0, 27.0))
    assert not choice.split
    assert mode == SPLIT_ON  # the caller applies the choice
    assert seen.count(True) == seen.count(False) == prefill_choice.PROBE_ROUNDS + 1
    assert seen[:4] == [False, True, True, False]  # the paths take turns going first
    assert heats == len(seen)  # a fresh prefill before every timed forward


def test_a_runner_keeps_the_path_its_probe_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a real (CPU) runner, thresholds lowered so the tiny model reaches the split: the probe
    runs both paths, records why, and sets the mode; a runner whose split is off runs nothing."""
    monkeypatch.setattr(batch_plan, "BUCKETED_MIN_PREFIX", 32)
    monkeypatch.setattr(batch_plan, "BUCKETED_MIN_NEW", 8)
    monkeypatch.setattr(prefill_choice, "BUCKETED_MIN_PREFIX", 32)
    monkeypatch.setattr(prefill_choice, "BUCKETED_MIN_NEW", 8)
    monkeypatch.setattr(prefill_choice, "PROBE_PREFIX", 96)
    runner = ModelRunner(preset("tiny-random"), 64, 4)
    assert apply_faster_prefill(runner) is None  # the split is off on CPU
    assert runner.attention.prefill_choice is None
    split_on = AttentionMode(
        paged_decode=False, paged_prefill=False, explicit_masks=True, bucketed_prefill=True
    )
    runner.attention.mode = split_on
    forwards: list[AttentionMode] = []
    plain_forward = runner.forward

    def counted(batch: Sequence[SeqChunk]) -> torch.Tensor:
        forwards.append(runner.attention.mode)
        plan = runner._plan(list(batch))
        if batch[0].start_pos:  # the probed chunk, not the fresh prefill before it
            assert (plan.cached[0].split is not None) == runner.attention.mode.bucketed_prefill
        else:
            assert not plan.cached
        return plain_forward(batch)

    monkeypatch.setattr(runner, "forward", counted)
    choice = apply_faster_prefill(runner)
    assert choice is not None and (choice.new_tokens, choice.cached_tokens) == (8, 96)
    reason = choice.describe()  # the log line: both medians and the pick, not their sizes
    assert f"split {choice.split_ms:.2f} ms, paged {choice.paged_ms:.2f} ms" in reason
    assert runner.attention.prefill_choice == choice
    assert runner.attention.mode == choice.applied_to(split_on)
    assert len(forwards) == 2 * 2 * (prefill_choice.PROBE_ROUNDS + 1)  # each after a heat
