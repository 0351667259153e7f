"""The source side of a pull: what a worker hands a peer that fetches its blocks, as a copy
(`export_blocks`) or in place (`pin_run`, then `unpin`). The target side is `pull_admission.py`."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence as Seq

import torch

from kvmesh.proto.block_hash import BlockHash
from kvmesh.workers.engine.host_tier import HostTier
from kvmesh.workers.kv.block_pool import BlockId, BlockPool
from kvmesh.workers.model.runner import ModelRunner
from kvmesh.workers.transfer.block_export import BlockExport


class PullSource:
    """Serves a worker's blocks to its peers.

    Invariant (checked by `check_invariants`): every entry of the pinned list holds one pool ref,
    taken by `pin_run` and not yet let go by `unpin` (a block pinned twice is listed twice).
    """

    def __init__(
        self, worker_id: str, pool: BlockPool, runner: ModelRunner, host_tier: HostTier
    ) -> None:
        self.worker_id = worker_id
        self.pool = pool
        self.runner = runner
        self.host_tier = host_tier
        self._peer_pins: list[BlockId] = []

    def export_blocks(self, hashes: Seq[BlockHash], to_cpu: bool = True) -> BlockExport:
        """The leading run of `hashes` this worker holds (device tier, then host tier)."""
        ids = self.pool.match_prefix(hashes)
        parts = [self.runner.block_io.export_blocks(ids)] if ids else []  # waits for blocks landing
        found = list(hashes[: len(ids)])
        from_host, run = self.host_tier.export_after(hashes[len(ids) :])
        if from_host is not None:
            parts.append(from_host)
            found += run
        if not parts:
            parts = [self.runner.block_io.export_blocks([])]
        blocks = torch.cat(parts) if len(parts) > 1 else parts[0]
        return BlockExport(self.worker_id, tuple(found), blocks.cpu() if to_cpu else blocks)

    def pin_run(self, hashes: Seq[BlockHash]) -> list[BlockId]:
        """Take refs on the leading device run of `hashes` so a peer can copy it in place
        (same-GPU and NCCL pulls); `unpin` releases them."""
        ids = self.pool.match_prefix(hashes)
        self.runner.block_io.settle_layer_writes(ids)  # the peer reads them on its own stream
        self.pool.acquire(ids)
        self._peer_pins.extend(ids)
        return ids

    def unpin(self, ids: Seq[BlockId]) -> None:
        for b in ids:
            self._peer_pins.remove(b)
        self.pool.free(ids)

    def held_blocks(self) -> list[BlockId]:
        """The pool refs held for peers, one entry per ref."""
        return list(self._peer_pins)

    def check_invariants(self) -> None:
        for block, num_pins in Counter(self._peer_pins).items():
            ref_count = self.pool.ref_count(block)
            assert ref_count >= num_pins, f"block {block}: {num_pins} pins, {ref_count} refs"
