"""Prices pulling a prefix from a peer against recomputing it, for one candidate worker.

    target t holds k leading blocks, peer p holds m > k:
      recompute:  prefill(n - k*bs new tokens, k*bs cached)
      pull:       transfer(p -> t, (m - k) blocks) + prefill(n - m*bs new tokens, m*bs cached)

The cheaper option wins; the pull is planned only when it saves time. The link price comes from
the coordinator's measured link table (same device, same node, other node).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvmesh.coordinator.index.mirror import WorkerId
from kvmesh.coordinator.routing.cost_model import CostModel
from kvmesh.coordinator.routing.policy import RouteQuery, WorkerView
from kvmesh.proto.block_hash import num_reusable_tokens

TransferPrice = Callable[[WorkerId, WorkerId, int], float]
"""(source, destination, num_tokens) -> milliseconds."""
TransferPrices = Callable[[WorkerId, Sequence[WorkerId], np.ndarray], np.ndarray]
"""(source, destinations, num_tokens per destination) -> milliseconds per destination, each
what `TransferPrice` gives for that destination."""


@dataclass(frozen=True, slots=True)
class PullPlan:
    source: WorkerId
    """The peer that holds the longer prefix."""
    num_blocks: int
    """Leading prompt blocks the target holds once the pull is done (the peer's match)."""
    from_block: int
    """First block moved (the target's own match)."""
    transfer_ms: float
    """Predicted transfer time."""


@dataclass(frozen=True, slots=True)
class PrefillOption:
    prefill_ms: float
    """Predicted time to have the prompt's KV ready on the target (transfer + prefill)."""
    pull: PullPlan | None


def best_peer(workers: Sequence[WorkerView]) -> WorkerView | None:
    """The worker holding the longest prefix on its device tier: the only source worth pricing."""
    peer = max(workers, key=lambda v: v.matched_device_blocks, default=None)
    return peer if peer is not None and peer.matched_device_blocks > 0 else None


def cheapest_prefill(
    query: RouteQuery,
    target: WorkerView,
    peer: WorkerView | None,
    cost_model: CostModel,
    transfer_ms: TransferPrice | None,
) -> PrefillOption:
    bs, n = query.block_size, query.prompt_len
    cached = num_reusable_tokens(n, target.matched_blocks, bs)
    best = PrefillOption(cost_model.prefill_ms(n - cached, cached), None)
    if transfer_ms is None or peer is None:
        return best
    if peer.worker_id == target.worker_id or peer.matched_device_blocks <= target.matched_blocks:
        return best
    num_blocks = peer.matched_device_blocks
    moved_tokens = (num_blocks - target.matched_blocks) * bs
    pulled_cached = num_reusable_tokens(n, num_blocks, bs)
    link_ms = transfer_ms(peer.worker_id, target.worker_id, moved_tokens)
    with_pull = link_ms + cost_model.prefill_ms(n - pulled_cached, pulled_cached)
    if with_pull >= best.prefill_ms:
        return best
    plan = PullPlan(peer.worker_id, num_blocks, target.matched_blocks, link_ms)
    return PrefillOption(with_pull, plan)
