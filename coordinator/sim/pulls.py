"""Pull pricing for the coordinator from the simulator's cost model (one link type)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvmesh.coordinator.index.mirror import WorkerId
from kvmesh.coordinator.sim.cost_model import SimCostModel
from kvmesh.workers.contract.replies import PrefillFacts
from kvmesh.workers.contract.requests import Transport


class SimPulls:
    """Pull pricing for the coordinator from the simulator's cost model (one link type)."""

    uniform_price = True  # one link type: the price of a pull is its tokens'

    def __init__(self, cost: SimCostModel) -> None:
        self.cost = cost
        self.num_pulls = 0
        self.num_failed_pulls = 0

    def price(self, source: WorkerId, target: WorkerId, num_tokens: int) -> float:
        return self.cost.transfer_ms(num_tokens)

    def price_many(
        self, source: WorkerId, targets: Sequence[WorkerId], num_tokens: np.ndarray
    ) -> np.ndarray:
        return self.cost.transfer_ms_array(num_tokens)

    def transport(self, source: str, target: str) -> Transport:
        return Transport.OBJECT_STORE

    def observe(self, source: str, target: str, facts: PrefillFacts) -> None:
        self.num_pulls += 1
        self.num_failed_pulls += facts.pulled_tokens == 0
