"""`sim_vs_real.py --between-steps-from-counters`: the engines' time between steps, read from a
report's own counters."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def sim_vs_real(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("sim_vs_real")


def _row(per_worker: dict[str, tuple[int, int, int, float, float]]) -> dict[str, Any]:
    """per worker: (requests, prefill steps, decode steps, decode batch, host ms a step)."""
    return {
        "requests_per_worker": {w: v[0] for w, v in per_worker.items()},
        "engine_steps": {
            w: {
                "prefill_steps": p,
                "decode_steps": d,
                "decode_batch": b,
                "host_ms_per_step": h,
            }
            for w, (_, p, d, b, h) in per_worker.items()
        },
    }


def test_the_time_between_steps_is_per_sequence_the_steps_carried(sim_vs_real: ModuleType) -> None:
    # w0: 10 requests, 10 prefill steps and 20 decode steps of 3 -> 70 sequences, 30 steps
    # at 0.7 ms = 21 ms between them; w1 the same work at twice the time.
    report = {
        "results": {
            "round_robin": [
                _row({"w0": (10, 10, 20, 3.0, 0.7), "w1": (10, 10, 20, 3.0, 1.4)}),
            ]
        }
    }
    assert sim_vs_real.between_steps_per_seq_ms(report) == pytest.approx((21 + 42) / (70 + 70))


def test_a_report_without_counters_has_no_time_between_steps(sim_vs_real: ModuleType) -> None:
    report = {"results": {"kvmesh": [{"rate_rps": 4.0}], "round_robin": []}}
    assert sim_vs_real.between_steps_per_seq_ms(report) is None
    no_host = _row({"w0": (10, 10, 20, 3.0, 0.7)})
    del no_host["engine_steps"]["w0"]["host_ms_per_step"]
    assert sim_vs_real.between_steps_per_seq_ms({"results": {"kvmesh": [no_host]}}) is None
