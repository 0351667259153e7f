"""The registry of routing policies: `POLICIES` names every policy a user can pick
(`kvmesh up --policy NAME`, `kvmesh simulate --policies ...`); `make_policy` builds one.

The interface lives in `policy`; kvmesh's policy in `kvmesh_policy` (its knobs in
`kvmesh_weights`); the simple baselines in `simple_policies`; reimplementations of other
systems' routers in `baselines`.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from kvmesh.coordinator.routing.baselines import DynamoKvPolicy, SglangCacheAwarePolicy
from kvmesh.coordinator.routing.cost_model import CostModel
from kvmesh.coordinator.routing.kvmesh_policy import KvmeshPolicy
from kvmesh.coordinator.routing.kvmesh_weights import KvmeshWeights
from kvmesh.coordinator.routing.policy import RoutingPolicy
from kvmesh.coordinator.routing.simple_policies import (
    LeastLoadedPolicy,
    RoundRobinPolicy,
    SessionStickyPolicy,
)

__all__ = ["POLICIES", "make_policy"]


POLICIES: dict[str, type[RoutingPolicy]] = {
    p.name: p
    for p in (
        KvmeshPolicy,
        RoundRobinPolicy,
        LeastLoadedPolicy,
        SessionStickyPolicy,
        SglangCacheAwarePolicy,
        DynamoKvPolicy,
    )
}


def make_policy(
    name: str,
    cost_model: CostModel,
    rng: random.Random,
    clock: Callable[[], float] = time.monotonic,
    *,
    session_affinity_blocks: float | None = None,
) -> RoutingPolicy:
    """A fresh policy; `clock` (seconds) is what time-based policies (SGLang's tree) read;
    `session_affinity_blocks` overrides the kvmesh policy's session term (others ignore it)."""
    try:
        policy_type = POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown policy {name!r}; choose from {', '.join(sorted(POLICIES))}"
        ) from None
    if policy_type is KvmeshPolicy and session_affinity_blocks is not None:
        weights = KvmeshWeights(session_affinity_blocks=session_affinity_blocks)
        return KvmeshPolicy(cost_model, rng, clock, weights)
    return policy_type(cost_model, rng, clock)
