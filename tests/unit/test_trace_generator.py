"""Generated Mooncake-format traces: valid, deterministic, and shaped by their statistics."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from kvmesh.client import cli, trace_generator, trace_replay
from kvmesh.client.trace_generator import SHAPES, TraceShape

SMALL = TraceShape(num_requests=600, new_tokens_median=700, output_median=50)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_every_shape_writes_a_trace_the_reader_accepts(name: str, tmp_path: Path) -> None:
    shape = replace(SHAPES[name], num_requests=200)
    path = tmp_path / "t.jsonl"
    trace_generator.write_trace(trace_generator.generate(shape, 3), path)
    records = list(trace_replay.read_trace(path, shape.block_size))  # checks ids vs lengths
    assert len(records) == 200
    assert all(r.input_length <= shape.max_input_tokens for r in records)
    assert trace_generator.generate(shape, 3) == records
    assert trace_generator.generate(shape, 4) != records


def test_a_continuation_repeats_the_full_blocks_of_a_recent_prompt_and_quotes_its_answer() -> None:
    records = trace_generator.generate(replace(SMALL, continue_share=1.0), 1)
    for i, r in enumerate(records[1:100], 1):
        parents = [
            p
            for p in records[max(0, i - SMALL.recent_conversations) : i]
            if r.hash_ids[: p.input_length // 512] == p.hash_ids[: p.input_length // 512]
            and r.input_length >= p.input_length + p.output_length
            and p.input_length >= 3 * 512  # more than the root: a real continuation
        ]
        assert parents or r.hash_ids[:2] == (0, 1)  # else it opened on the (only) root


def test_reuse_grows_with_the_continue_share() -> None:
    shares = [
        trace_generator.reusable_share(
            trace_generator.generate(replace(SMALL, continue_share=c), 2)
        )
        for c in (0.0, 0.5, 0.9)
    ]
    assert shares[0] < shares[1] < shares[2]
    # Without continuations only the roots repeat: 2 blocks of each prompt, ~1,700 tokens.
    assert shares[0] == pytest.approx(1024 / (1024 + 700 * np.exp(0.5)), rel=0.2)


def test_burstiness_widens_the_gaps_but_keeps_the_rate() -> None:
    def gaps(b: float) -> np.ndarray:
        records = trace_generator.generate(replace(SMALL, num_requests=4000, burstiness=b), 5)
        return np.diff([r.timestamp_ms for r in records])

    poisson, bursty = gaps(1.0), gaps(8.0)
    assert (poisson.std() / poisson.mean()) ** 2 == pytest.approx(1.0, rel=0.15)
    assert (bursty.std() / bursty.mean()) ** 2 == pytest.approx(8.0, rel=0.3)
    assert bursty.mean() == pytest.approx(1000 / SMALL.rate_rps, rel=0.15)


def test_bad_shapes_name_the_field() -> None:
    with pytest.raises(ValueError, match="continue_share must be in"):
        TraceShape(continue_share=1.5)
    with pytest.raises(ValueError, match="rate_rps must be > 0"):
        TraceShape(rate_rps=0)
    with pytest.raises(ValueError, match="no field 'nope'"):
        trace_generator.make_shape("bursty_agents", {"nope": "1"})


def test_make_trace_command_writes_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "a.jsonl"
    args = ["make-trace", "--shape", "bursty_agents", "--shape-arg", "num_requests=50"]
    assert cli.main([*args, "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["records"] == 50 and 0 < summary["reusable_share"] < 1
    assert len(out.read_text().splitlines()) == 50
