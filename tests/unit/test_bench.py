"""`kvmesh bench`'s pure parts: when requests are sent and how responses become metrics."""

from __future__ import annotations

import numpy as np
import pytest

from kvmesh.client import cli
from kvmesh.client.bench import BenchSample, send_times, summarize
from kvmesh.client.workloads import WorkloadRequest


def requests(n: int, gap_ms: float) -> list[WorkloadRequest]:
    return [WorkloadRequest(i * gap_ms, np.arange(4, dtype=np.uint32), 2) for i in range(n)]


def test_send_times_follow_the_workload_or_a_seeded_poisson_rate() -> None:
    own = send_times(requests(10, 500.0), None, 2.0, seed=0)
    assert [t for t, _ in own] == [0.0, 0.5, 1.0, 1.5]
    poisson = send_times(requests(1000, 0.0), 50.0, 2.0, seed=1)
    again = send_times(requests(1000, 0.0), 50.0, 2.0, seed=1)
    assert [t for t, _ in poisson] == [t for t, _ in again]
    assert 60 < len(poisson) < 140 and all(t < 2.0 for t, _ in poisson)


def test_summarize_folds_responses_into_the_simulator_metrics() -> None:
    samples = [
        BenchSample(True, "w0", 100, 50, 10, 20.0),
        BenchSample(True, "w0", 100, 0, 0, 40.0),
        BenchSample(True, "w1", 200, 150, 0, 10.0),
        BenchSample(False, "", 100, 0, 0, None, "UNAVAILABLE: down"),
    ]
    m = summarize(samples, ["w0", "w1", "w2"], elapsed_s=2.0)
    assert m["hit_rate"] == 200 / 400 and m["pulled_rate"] == 10 / 400
    assert m["throughput_rps"] == 1.5 and m["num_failed"] == 1
    assert m["requests_per_worker"] == {"w0": 2, "w1": 1, "w2": 0}
    assert m["imbalance"] == 2.0  # max 2 / mean 1
    assert m["ttft_p50_ms"] == 20.0 and m["decisions_per_s"] is None


def test_summarize_reports_tpot_end_to_end_and_goodput_under_the_slo() -> None:
    samples = [
        BenchSample(True, "w0", 100, 0, 0, 100.0, e2e_ms=1100.0, num_output_tokens=11),  # 100/tok
        BenchSample(True, "w0", 100, 0, 0, 100.0, e2e_ms=2100.0, num_output_tokens=11),  # 200/tok
        BenchSample(True, "w1", 100, 0, 0, 3000.0, e2e_ms=3000.0, num_output_tokens=1),  # late
        BenchSample(True, "w1", 100, 0, 0, 50.0, e2e_ms=50.0, num_output_tokens=1),  # no TPOT
    ]
    m = summarize(samples, ["w0", "w1"], elapsed_s=2.0, slo_ttft_ms=2000.0, slo_tpot_ms=150.0)
    assert (m["tpot_p50_ms"], m["tpot_p90_ms"]) == (150.0, 190.0)  # two samples: 100 and 200
    assert m["e2e_p50_ms"] == 1600.0
    assert m["goodput_rps"] == 1.0 and m["slo_attainment"] == 0.5  # the first and the last
    assert samples[3].tpot_ms is None


def test_several_addresses_need_deal(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "--address", "127.0.0.1:1,127.0.0.1:2", "--workload", "shared_prefix"]
    assert cli.main([*argv, "--duration", "1"]) != 0
    assert "--deal sends to 2" in capsys.readouterr().err
