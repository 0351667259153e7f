"""The simulator of a kvmesh cluster, as `kvmesh simulate` and the benchmarks run it.

    workload -> prepare_requests (hash once) -> ClusterSimulation(policy).run() -> PolicyResult
                                                (cluster_simulation.py)          (report.py)

`SimConfig` is the simulated cluster; `simulate` runs each named policy over the same prepared
requests (`policy_names` puts the `oracle`, a bound rather than a policy, last).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from kvmesh.coordinator.routing.router import POLICIES
from kvmesh.coordinator.sim.cluster_simulation import ORACLE, SIM_MODEL, ClusterSimulation
from kvmesh.coordinator.sim.cost_model import SimCostModel
from kvmesh.coordinator.sim.report import PolicyResult, Slo
from kvmesh.coordinator.sim.worker import SimRequest
from kvmesh.proto.block_hash import block_hashes, namespace_hash
from kvmesh.workers.kv.warm_sessions import WarmSessionConfig


class Arrival(Protocol):
    """What the simulator needs of a workload request (kvmesh.client.workloads provides it)."""

    @property
    def arrival_ms(self) -> float: ...
    @property
    def token_ids(self) -> np.ndarray: ...
    @property
    def output_len(self) -> int: ...
    @property
    def session_id(self) -> str: ...
    @property
    def completion_ids(self) -> np.ndarray | None: ...


@dataclass(frozen=True, slots=True)
class SimConfig:
    """The simulated cluster."""

    num_workers: int
    """Workers (engines), each with its own pool."""
    capacity_tokens: int
    """KV capacity of each worker, in tokens."""
    block_size: int = 16
    """Tokens per KV block."""
    seed: int = 0
    """Seeds every policy's tie-breaking."""
    cost: SimCostModel = field(default_factory=SimCostModel)
    """Compute times (the router's model is derived from it: a calibrated coordinator)."""
    pulls: bool = True
    """Workers can pull prefixes from each other (policies that plan pulls, kvmesh's, use it)."""
    slo: Slo = field(default_factory=Slo)
    """What a request must meet to count towards goodput."""
    num_coordinators: int = 1
    """Coordinator replicas over the one fleet; arrivals go to them in turn, each routes with its
    own load tracker and policy state, all read one mirror, the workers' load reports and the
    request notes (each coordinator's of its routes, each worker's of its prefills and ends)."""
    report_interval_ms: float = 500.0
    """How often workers' own load reports reach the coordinators (the live health interval)."""
    reports_on_clock: bool = False
    """Take the reports at ticks of `report_interval_ms` on simulated time, as the live health
    loop does on its own clock, so a decision reads a report 0 to one interval old; off: at the
    first arrival an interval after the last report, just before it is routed
    (`sim/report_clock.py`)."""
    note_delay_ms: float = 1.0
    """How long request notes take to reach the coordinators: a coordinator's note of each
    route it makes, a worker's of each request it prefills and finishes (live: one append to a
    Redis stream, which every coordinator's follower is blocked reading)."""
    decision_log: bool = False
    """Replicas commit every decision to one ordered log and apply each other's from it in
    order (`routing/decision_log.py`), modelled by `SimDecisionLog`: entries reach replicas
    `note_delay_ms` after their commit, and each commit attempt costs `commit_trip_ms`."""
    commit_trip_ms: float = 1.0
    """A commit's round trip to Redis (`benchmarks/note_trip.py` measured a stream trip of
    0.74 ms p50 on a local Redis), added to the request's times per attempt."""
    speculative_dispatch: bool = False
    """With `decision_log`: the coordinators send a request before committing its decision
    (`CoordinatorConfig.speculative_dispatch`), so it reaches its worker without the commit's
    trips unless redirected; a redirected one arrives after the trips up to its redirect."""
    sessions: WarmSessionConfig | None = None
    """Workers keep idle sessions warm (as live workers do); None: plain LRU, as before. The
    oracle stays the shared-LRU bound either way."""
    host_capacity_tokens: int = 0
    """Each worker's host-memory tier, in tokens (catches what the device evicts; a hit costs a
    host-to-device copy at the cost model's transfer rate); 0: none, as before."""

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if not self.note_delay_ms >= 0 or not self.commit_trip_ms >= 0:
            raise ValueError(
                f"note_delay_ms and commit_trip_ms must be >= 0, got {self.note_delay_ms}"
                f" and {self.commit_trip_ms}"
            )
        if self.num_coordinators < 1 or self.report_interval_ms <= 0:
            raise ValueError(
                f"need >= 1 coordinator and a report interval > 0, got {self.num_coordinators}"
                f" and {self.report_interval_ms} ms"
            )
        if self.capacity_tokens < self.block_size:
            raise ValueError(
                f"capacity_tokens {self.capacity_tokens} is less than one block of "
                f"{self.block_size} tokens"
            )

    @property
    def num_blocks(self) -> int:
        """Blocks per worker."""
        return self.capacity_tokens // self.block_size

    @property
    def host_blocks(self) -> int:
        """Host-tier blocks per worker."""
        return self.host_capacity_tokens // self.block_size


def prepare_requests(arrivals: Iterable[Arrival], block_size: int) -> list[SimRequest]:
    """Hash every request once (prompt, and prompt + completion when the workload knows it)."""
    root = namespace_hash(SIM_MODEL)
    out = []
    last_ms = 0.0
    for i, a in enumerate(arrivals):
        if a.arrival_ms < last_ms:
            raise ValueError(f"request {i} arrives at {a.arrival_ms} ms, before {last_ms} ms")
        last_ms = a.arrival_ms
        prompt_len = len(a.token_ids)
        tokens = a.token_ids
        if a.completion_ids is not None and len(a.completion_ids):
            tokens = np.concatenate([a.token_ids, a.completion_ids[: a.output_len]])
        hashes = tuple(block_hashes(tokens, block_size, root))
        reserved = -(-(prompt_len + a.output_len) // block_size)
        out.append(
            SimRequest(
                i,
                f"r{i}",
                float(a.arrival_ms),
                prompt_len,
                int(a.output_len),
                a.session_id,
                hashes,
                prompt_len // block_size,
                reserved,
            )
        )
    return out


def simulate(
    config: SimConfig,
    requests: Sequence[SimRequest],
    policies: Sequence[str],
    on_done: Callable[[PolicyResult], None] | None = None,
) -> dict[str, PolicyResult]:
    """Run each named policy (and `oracle`, if named) over the same requests, in order."""
    results = {}
    for name in policies:
        result = ClusterSimulation(config, name, requests).run()
        results[name] = result
        if on_done is not None:
            on_done(result)
    return results


def policy_names(spec: str) -> list[str]:
    """`"all"` or a comma list -> validated names; the oracle always comes last."""
    names = list(POLICIES) if spec == "all" else [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n != ORACLE and n not in POLICIES]
    if unknown:
        raise ValueError(
            f"unknown policies {', '.join(unknown)}; choose from "
            f"{', '.join([*POLICIES, ORACLE])} or all"
        )
    names = [n for n in dict.fromkeys(names) if n != ORACLE]
    return [*names, ORACLE]


__all__ = [
    "Arrival",
    "SimConfig",
    "policy_names",
    "prepare_requests",
    "simulate",
]
