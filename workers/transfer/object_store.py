"""Pulls through Ray's object store: the source exports the run as one CPU tensor (works between
any two workers, on any devices and nodes)."""

from __future__ import annotations

from kvmesh.proto.block_hash import BlockHash
from kvmesh.workers.engine.pull_admission import BlockWriter, PullTargets
from kvmesh.workers.model.runner import ModelRunner
from kvmesh.workers.transfer.block_export import BlockExport
from kvmesh.workers.transfer.transport import PeerLookup, WriteOnEngine


class ObjectStoreTransport:
    def __init__(self, peers: PeerLookup, runner: ModelRunner) -> None:
        self._peers = peers
        self._runner = runner

    async def fetch(
        self, source: str, hashes: tuple[BlockHash, ...], write: WriteOnEngine
    ) -> int | None:
        export = await self._peers(source).export(hashes)
        if export.hashes != hashes[: len(export.hashes)]:
            raise ValueError(f"peer {source} exported another chain than the one asked for")
        if export.blocks.shape[0] != len(export.hashes):
            raise ValueError(
                f"{export.blocks.shape[0]} blocks for {len(export.hashes)} hashes from {source}"
            )

        return await write(export_writer(self._runner, export))


def export_writer(runner: ModelRunner, export: BlockExport) -> BlockWriter:
    """Writes an exported run into the reserved blocks it lines up with."""

    def fill(targets: PullTargets) -> int:
        n = targets.fillable(len(export.hashes))
        if n:
            first = targets.first
            runner.block_io.import_blocks(targets.blocks[:n], export.blocks[first : first + n])
        return n

    return fill
