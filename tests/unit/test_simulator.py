"""The routing simulator: real router, mirror and pools on simulated time; and its CLI contract."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvmesh.client import cli, trace_replay, workloads
from kvmesh.client.workloads import WorkloadRequest
from kvmesh.coordinator.sim.cluster_simulation import ClusterSimulation
from kvmesh.coordinator.sim.cost_model import SimCostModel
from kvmesh.coordinator.sim.report import METRIC_KEYS
from kvmesh.coordinator.sim.simulator import (
    SimConfig,
    policy_names,
    prepare_requests,
    simulate,
)
from kvmesh.coordinator.sim.worker import SimRequest

SHARED = {
    "num_groups": 8,
    "users_per_group": 12,
    "system_prompt_len": 256,
    "question_len": 32,
    "output_len": 16,
    "rate_rps": 200.0,
}


@pytest.fixture(scope="module")
def shared_prefix() -> list[SimRequest]:
    return prepare_requests(workloads.generate("shared_prefix", 3, SHARED), 16)


def small_config(**kw: object) -> SimConfig:
    # 4 workers of 96 blocks; 8 system prompts of 16 blocks: placement decides the hit rate.
    return SimConfig(**{"num_workers": 4, "capacity_tokens": 1536, "block_size": 16, **kw})  # type: ignore[arg-type]


def test_runs_are_deterministic_for_a_seed(shared_prefix: list[SimRequest]) -> None:
    names = ["kvmesh", "sglang", "dynamo"]
    first = simulate(small_config(seed=5), shared_prefix, names)
    second = simulate(small_config(seed=5), shared_prefix, names)
    for name in names:
        a, b = first[name], second[name]
        assert (a.cached_tokens, a.pulled_tokens, a.ttft_ms) == (
            b.cached_tokens,
            b.pulled_tokens,
            b.ttft_ms,
        )
        assert a.requests_per_worker == b.requests_per_worker


def test_oracle_bounds_every_policy_without_pulls(shared_prefix: list[SimRequest]) -> None:
    results = simulate(small_config(pulls=False), shared_prefix, policy_names("all"))
    oracle = results.pop("oracle")
    assert results and all(r.hit_rate <= oracle.hit_rate + 1e-9 for r in results.values())
    assert all(r.pulled_rate == 0 for r in results.values())


def test_round_robin_spreads_requests_evenly(shared_prefix: list[SimRequest]) -> None:
    result = ClusterSimulation(small_config(), "round_robin", shared_prefix).run()
    assert max(result.requests_per_worker) - min(result.requests_per_worker) <= 1
    assert sum(result.requests_per_worker) == len(shared_prefix)


def test_kvmesh_reuses_more_than_round_robin_on_shared_prefixes(
    shared_prefix: list[SimRequest],
) -> None:
    config = small_config(pulls=False)
    kvmesh = ClusterSimulation(config, "kvmesh", shared_prefix).run()
    rr = ClusterSimulation(config, "round_robin", shared_prefix).run()
    assert kvmesh.hit_rate > 1.5 * rr.hit_rate
    assert kvmesh.ttft_p90_ms < rr.ttft_p90_ms


def test_pools_and_index_stay_consistent_after_a_run(shared_prefix: list[SimRequest]) -> None:
    sim = ClusterSimulation(small_config(), "kvmesh", shared_prefix)
    result = sim.run()
    assert result.num_requests == len(shared_prefix)
    sim.mirror.check_invariants()
    sim.load.check_invariants()
    for worker in sim.workers:
        worker.pool.check_invariants()
        worker.check_invariants()
        assert worker.pool.num_free == worker.pool.num_blocks  # everything finished and freed
        indexed = set(sim.mirror.worker_hashes(worker.worker_id))
        assert indexed == set(worker.pool.cached_hashes())  # the mirror follows the pool exactly


def test_the_simulation_drives_the_real_coordinator(shared_prefix: list[SimRequest]) -> None:
    cheap_links = SimCostModel(transfer_per_token_ms=0.0001)
    sim = ClusterSimulation(small_config(cost=cheap_links), "kvmesh", shared_prefix)
    result = sim.run()
    stats = sim.coordinator.stats()
    assert stats["num_requests"] == len(shared_prefix) and stats["num_failed_requests"] == 0
    assert stats["prompt_tokens"] == result.prompt_tokens
    assert stats["cached_tokens"] == result.cached_tokens  # the facts the workers reported
    assert stats["pulled_tokens"] > 0 and sim.coordinator.transfers is not None
    assert sim.coordinator.transfers.num_pulls > 0
    assert not sim.load.num_running(sim.worker_ids[0])  # every stream closed: load released


def test_pulls_are_counted_apart_from_local_hits(shared_prefix: list[SimRequest]) -> None:
    cheap_links = SimCostModel(transfer_per_token_ms=0.0001)
    with_pulls = ClusterSimulation(small_config(cost=cheap_links), "kvmesh", shared_prefix).run()
    assert with_pulls.pulled_rate > 0
    assert with_pulls.hit_rate + with_pulls.pulled_rate <= 1.0
    dynamo = ClusterSimulation(small_config(cost=cheap_links), "dynamo", shared_prefix).run()
    assert dynamo.pulled_rate == 0  # only kvmesh plans pulls


def test_a_hand_written_trace_gives_the_hit_rate_it_implies(tmp_path: Path) -> None:
    # One worker, one big pool: the second request reuses the two full blocks it shares.
    trace = tmp_path / "tiny.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 20, "output_length": 2, "hash_ids": [0, 1, 2]},
        {"timestamp": 1000, "input_length": 24, "output_length": 2, "hash_ids": [0, 1, 3]},
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reqs = trace_replay.replay_file(trace, trace_replay.TraceReplayConfig(block_size=8))
    prepared = prepare_requests(reqs, 8)
    result = ClusterSimulation(SimConfig(1, 1024, 8), "kvmesh", prepared).run()
    assert result.cached_tokens == 16 and result.prompt_tokens == 44
    assert result.ttft_ms[1] < result.ttft_ms[0]


def test_multi_turn_reuses_the_quoted_answer() -> None:
    prompt = np.arange(32, dtype=np.uint32)
    answer = np.arange(100, 116, dtype=np.uint32)
    turns = [
        WorkloadRequest(0.0, prompt, 16, "s", answer),
        WorkloadRequest(5000.0, np.concatenate([prompt, answer, prompt[:8]]), 4, "s"),
    ]
    result = ClusterSimulation(SimConfig(1, 1024, 16), "kvmesh", prepare_requests(turns, 16)).run()
    assert result.cached_tokens == 48  # the prompt's 2 blocks and the answer's block


def test_requests_larger_than_a_worker_are_refused() -> None:
    big = [WorkloadRequest(0.0, np.zeros(100, dtype=np.uint32), 100)]
    sim = ClusterSimulation(SimConfig(2, 64, 16), "kvmesh", prepare_requests(big, 16))
    with pytest.raises(ValueError, match="needs 13 blocks; worker w\\d has 4"):
        sim.run()


def test_policy_names_validates_and_puts_the_oracle_last() -> None:
    assert policy_names("oracle,kvmesh,kvmesh") == ["kvmesh", "oracle"]
    assert policy_names("all")[-1] == "oracle" and "sglang" in policy_names("all")
    with pytest.raises(ValueError, match="unknown policies nope"):
        policy_names("kvmesh,nope")


def test_cli_json_has_the_contract_keys(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(
        [
            "simulate",
            "--workload",
            "shared_prefix",
            *("--workload-arg", "num_groups=3", "--workload-arg", "users_per_group=4"),
            *("--workers", "2", "--capacity-tokens", "8192", "--policies", "kvmesh,round_robin"),
            "--json",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    doc = json.loads(out)
    assert set(doc["policies"]) == {"kvmesh", "round_robin", "oracle"}
    for metrics in doc["policies"].values():
        assert set(METRIC_KEYS) <= set(metrics)
        assert all(isinstance(metrics[k], float) for k in METRIC_KEYS)


def test_cli_table_and_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["simulate", "--workload", "rag", "--workload-arg", "num_requests=20"]
    args += ["--workers", "2", "--capacity-tokens", "8192", "--policies", "round_robin"]
    assert cli.main(args) == 0
    table = capsys.readouterr().out
    assert "round_robin" in table and "oracle" in table and "hit %" in table
    assert cli.main([*args, "--policies", "nope"]) == 2
    assert "unknown policies nope" in capsys.readouterr().err
    assert cli.main([*args, "--cost", "nope=1"]) == 2
    assert "unknown cost-model field" in capsys.readouterr().err


def test_warm_sessions_and_a_host_tier_run_on_the_real_classes() -> None:
    from kvmesh.workers.kv.warm_sessions import WarmSessionConfig

    overrides = {"num_sessions": 24, "turns_per_session": 3, "think_time_s": 2.0}
    requests = prepare_requests(workloads.generate("multi_turn", 1, overrides), 16)
    base = small_config(capacity_tokens=8192)
    plain = ClusterSimulation(base, "kvmesh", requests).run()
    config = small_config(
        capacity_tokens=8192,
        sessions=WarmSessionConfig(idle_ttl_s=60.0, budget_fraction=0.5),
        host_capacity_tokens=32768,
    )
    sim = ClusterSimulation(config, "kvmesh", requests)
    result = sim.run()
    for w in sim.workers:
        w.check_invariants()
        assert w.sessions is not None and w.host is not None
    assert sum(w.sessions.stats().num_sessions for w in sim.workers if w.sessions) > 0
    assert result.cached_tokens + result.pulled_tokens >= plain.cached_tokens + plain.pulled_tokens


def test_service_latency_delays_first_and_last_tokens_and_changes_no_routing(
    shared_prefix: list[SimRequest],
) -> None:
    runs = []
    for latency in (0.0, 16.0):
        config = small_config(seed=2, cost=SimCostModel(service_latency_ms=latency))
        simulation = ClusterSimulation(config, "kvmesh", shared_prefix)
        result = simulation.run()
        runs.append((result, simulation.request_times()))
    (plain, plain_times), (late, late_times) = runs
    assert late.requests_per_worker == plain.requests_per_worker
    assert (late.cached_tokens, late.pulled_tokens) == (plain.cached_tokens, plain.pulled_tokens)
    for (ttft, tpot, e2e), (ttft2, tpot2, e2e2) in zip(plain_times, late_times, strict=True):
        assert ttft2 == pytest.approx(ttft + 16.0)
        assert e2e2 == pytest.approx(e2e + 16.0)
        assert tpot2 == pytest.approx(tpot)


def test_replicas_replay_each_others_routes_from_the_notes(
    shared_prefix: list[SimRequest],
) -> None:
    sim = ClusterSimulation(small_config(num_coordinators=2), "kvmesh", shared_prefix)
    sim.run()
    routed = [c.stats()["num_requests"] for c in sim.coordinators]
    assert sum(routed) == len(shared_prefix)
    for k, coordinator in enumerate(sim.coordinators):
        peers = routed[1 - k]
        # Every peer request, but those whose notes were still on their way when arrivals ended.
        assert peers - 2 <= coordinator.peer_routes.num_taken <= peers
        coordinator.peer_routes.check_invariants()
        coordinator.load.check_invariants()


def test_one_coordinator_is_not_changed_by_the_notes(shared_prefix: list[SimRequest]) -> None:
    unheard = small_config(note_delay_ms=1e9)  # its own notes never land
    a = ClusterSimulation(unheard, "kvmesh", shared_prefix).run()
    b = ClusterSimulation(small_config(note_delay_ms=0.0), "kvmesh", shared_prefix).run()
    assert (a.cached_tokens, a.pulled_tokens, a.ttft_ms) == (
        b.cached_tokens,
        b.pulled_tokens,
        b.ttft_ms,
    )


def test_one_coordinator_places_the_same_with_the_decision_log(
    shared_prefix: list[SimRequest],
) -> None:
    a = ClusterSimulation(small_config(), "kvmesh", shared_prefix).run()
    free = ClusterSimulation(
        small_config(decision_log=True, commit_trip_ms=0.0), "kvmesh", shared_prefix
    ).run()
    assert (a.cached_tokens, a.pulled_tokens, a.ttft_ms, a.requests_per_worker) == (
        free.cached_tokens,
        free.pulled_tokens,
        free.ttft_ms,
        free.requests_per_worker,
    )
    # A 1 ms commit holds each request back from its worker by one trip.
    trip = ClusterSimulation(
        small_config(decision_log=True, commit_trip_ms=1.0), "kvmesh", shared_prefix
    ).run()
    assert trip.commit_attempts_per_request == 1.0 and trip.commit_ms_mean == 1.0
    # The first request meets an empty fleet, so the same decision: its first token one trip
    # later. (Later ones may be placed otherwise: their decisions are priced 1 ms later.)
    assert trip.ttft_ms[0] == pytest.approx(a.ttft_ms[0] + 1.0)


def test_one_coordinator_with_speculative_dispatch_pays_no_commit_trip(
    shared_prefix: list[SimRequest],
) -> None:
    """Alone, a replica never loses a commit, so with speculative dispatch every request
    reaches its worker at once, as without the log, whatever the trip."""
    a = ClusterSimulation(small_config(), "kvmesh", shared_prefix).run()
    spec = ClusterSimulation(
        small_config(decision_log=True, commit_trip_ms=1.0, speculative_dispatch=True),
        "kvmesh",
        shared_prefix,
    ).run()
    assert (a.cached_tokens, a.pulled_tokens, a.ttft_ms, a.requests_per_worker) == (
        spec.cached_tokens,
        spec.pulled_tokens,
        spec.ttft_ms,
        spec.requests_per_worker,
    )
    assert spec.commit_attempts_per_request == 1.0
    assert spec.commit_ms_mean == 0.0 and spec.redirects_per_request == 0.0


def test_replicas_with_speculative_dispatch_hold_back_only_redirected_requests(
    shared_prefix: list[SimRequest],
) -> None:
    config = small_config(
        num_coordinators=2, decision_log=True, commit_trip_ms=1.0, speculative_dispatch=True
    )
    sim = ClusterSimulation(config, "kvmesh", shared_prefix)
    result = sim.run()  # raises if a request never got its last token
    log = sim.decision_log
    assert log is not None and len(log) == len(shared_prefix)
    redirects = sum(c.counters.num_redirects for c in sim.coordinators)
    sends = sum(c.counters.num_speculative_sends for c in sim.coordinators)
    assert sends == len(shared_prefix) and redirects > 0  # simultaneous decisions moved some
    assert result.redirects_per_request == redirects / len(shared_prefix)
    # Only a redirect holds a request back, by the trips before it (here one: none is forced).
    held = [ms for ms in sim._commit_ms if ms > 0]  # noqa: SLF001 - the simulation's record
    assert len(held) == redirects and all(ms >= 1.0 for ms in held)
    placed = {p.request_id for p in log._entries}  # noqa: SLF001
    assert len(placed) == len(shared_prefix)
    assert sum(rid.endswith(".r1") for rid in placed) == redirects


def test_replicas_with_the_decision_log_apply_every_decision_in_order(
    shared_prefix: list[SimRequest],
) -> None:
    sim = ClusterSimulation(
        small_config(num_coordinators=2, decision_log=True), "kvmesh", shared_prefix
    )
    sim.run()
    log = sim.decision_log
    assert log is not None
    assert len(log) == len(shared_prefix)  # one entry per decision, lost commits retried
    log.check_invariants()
    attempts = sum(c.counters.num_commit_attempts for c in sim.coordinators)
    assert attempts > len(shared_prefix)  # replicas deciding at the same time lost some
    for coordinator in sim.coordinators:
        # Every entry, but those still on their way when arrivals ended.
        assert len(log) - 2 <= coordinator.decisions.cursor.applied_seq <= len(log)
        assert coordinator.counters.num_forced_commits == 0
        coordinator.decisions.cursor.check_invariants()
        coordinator.load.check_invariants()


def test_reports_on_the_clock_change_no_placement_that_reads_no_load(
    shared_prefix: list[SimRequest],
) -> None:
    on_arrivals = ClusterSimulation(small_config(), "round_robin", shared_prefix)
    on_clock = ClusterSimulation(small_config(reports_on_clock=True), "round_robin", shared_prefix)
    a, b = on_arrivals.run(), on_clock.run()
    assert a.requests_per_worker == b.requests_per_worker
    assert (a.cached_tokens, a.ttft_ms) == (b.cached_tokens, b.ttft_ms)
    assert on_clock._reports.num_reports > 0
    on_clock._reports.check_invariants()
