"""A pull source as the puller's transports call it: the peer's Ray actor, and, when the peer runs
on the same node, its `PeerChannel` for the small calls on a pull's path (pin, unpin, agreeing to
an NCCL send). Exports and the CUDA IPC handle always go over Ray."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from kvmesh.proto.block_hash import BlockHash
from kvmesh.workers.transfer.block_export import BlockExport
from kvmesh.workers.transfer.peer_channel import (
    BlockingChannel,
    ChannelError,
    ChannelOp,
    PeerChannel,
)

log = logging.getLogger(__name__)


class PeerSource:
    """Invariant: the channel is looked up at most once (`_looked_up`); a channel that breaks is
    dropped and this source's calls go over Ray from then on. The blocking end (`_blocking`) is
    connected with the channel and dropped alone when it breaks."""

    def __init__(self, actor: Any, node_id: str) -> None:
        self.actor = actor
        self._node_id = node_id
        self._channel: PeerChannel | None = None
        self._blocking: BlockingChannel | None = None
        self._looked_up = False
        self._lookup = asyncio.Lock()

    async def channel(self) -> PeerChannel | None:
        """The peer's channel if it runs on this node (connected on first use), else None."""
        async with self._lookup:
            if not self._looked_up:
                self._looked_up = True
                address: tuple[str, str] | None = await self.actor.channel_address.remote()
                if address is not None and address[0] == self._node_id:
                    try:
                        self._channel = await PeerChannel.connect(address[1])
                        self._blocking = BlockingChannel(address[1])
                    except OSError as exc:
                        log.warning("peer channel %s unreachable, using Ray: %s", address[1], exc)
            if self._channel is not None and self._channel.broken:
                self._channel = None
            return self._channel

    def blocking_channel(self) -> BlockingChannel | None:
        """The channel's blocking end for the engine thread, once `channel` has connected it."""
        if self._blocking is not None and self._blocking.broken:
            self._blocking = None
        return self._blocking

    async def pin(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Pin the leading run of `hashes` the peer holds on its device; its block ids."""
        channel = await self.channel()
        if channel is not None:
            return await channel.call(ChannelOp.PIN, hashes) or []
        ids: list[int] = await self.actor.pin_blocks.remote(list(hashes))
        return ids

    async def unpin(self, ids: Sequence[int]) -> None:
        """Let go of a run `pin` took. Never lost: a broken channel falls back to Ray."""
        channel = await self.channel()
        if channel is not None:
            try:
                await channel.call(ChannelOp.UNPIN, ids)
                return
            except ChannelError as exc:
                log.warning("unpin over the peer channel failed, using Ray: %s", exc)
        self.actor.unpin_blocks.remote(list(ids))

    async def nccl_accept(self, hashes: Sequence[BlockHash], dst_rank: int) -> list[int] | None:
        """The peer pins the run and starts sending it to `dst_rank`; None while it is busy."""
        channel = await self.channel()
        if channel is not None:
            return await channel.call(ChannelOp.NCCL_ACCEPT, hashes, dst_rank)
        ids: list[int] | None = await self.actor.nccl_accept.remote(list(hashes), dst_rank)
        return ids

    async def export(self, hashes: Sequence[BlockHash]) -> BlockExport:
        export: BlockExport = await self.actor.export_blocks.remote(list(hashes))
        return export

    async def ipc_handle(self) -> tuple[Any, Any] | None:
        handle: tuple[Any, Any] | None = await self.actor.ipc_handle.remote()
        return handle

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
        if self._blocking is not None:
            self._blocking.close()
