"""The peer channel over a real Unix socket: requests answered in order, None and errors carried
back, a caller that sends garbage dropped while others are served, a source that died seen as
broken."""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import Sequence

import pytest

from kvmesh.workers.transfer import peer_channel
from kvmesh.workers.transfer.peer_channel import (
    BlockingChannel,
    ChannelError,
    ChannelOp,
    PeerChannel,
)


class Source:
    """Handlers as a worker answers them: PIN gives each hash's position + 100, NCCL_ACCEPT is
    busy for rank 7, UNPIN remembers what it was given; hash 13 fails."""

    def __init__(self) -> None:
        self.unpinned: list[int] = []

    async def pin(self, hashes: Sequence[int], _: int) -> list[int] | None:
        if 13 in hashes:
            raise KeyError("unlucky hash")
        await asyncio.sleep(0.001 * (len(hashes) % 3))  # answers take different times
        return [100 + i for i in range(len(hashes))]

    async def unpin(self, ids: Sequence[int], _: int) -> list[int] | None:
        self.unpinned += ids
        return []

    async def accept(self, hashes: Sequence[int], rank: int) -> list[int] | None:
        return None if rank == 7 else [rank] * len(hashes)


async def served(source: Source) -> tuple[asyncio.AbstractServer, str]:
    path = os.path.join(tempfile.mkdtemp(), "peer.sock")
    handlers = {ChannelOp.PIN: source.pin, ChannelOp.UNPIN: source.unpin}
    handlers[ChannelOp.NCCL_ACCEPT] = source.accept
    return await peer_channel.serve(path, handlers), path


def test_requests_get_their_own_answers_in_order() -> None:
    async def scenario() -> None:
        source = Source()
        server, path = await served(source)
        channel = await PeerChannel.connect(path)
        big = [2**64 - 1 - i for i in range(480)]  # full 64-bit hashes survive the wire
        answers = await asyncio.gather(
            *(channel.call(ChannelOp.PIN, big[:n]) for n in (480, 1, 0, 5))
        )
        assert answers == [[100 + i for i in range(n)] for n in (480, 1, 0, 5)]
        assert await channel.call(ChannelOp.NCCL_ACCEPT, [1, 2], 3) == [3, 3]
        assert await channel.call(ChannelOp.NCCL_ACCEPT, [1, 2], 7) is None
        assert await channel.call(ChannelOp.UNPIN, [5, 2**32 - 1]) == []
        assert source.unpinned == [5, 2**32 - 1]
        channel.close()
        server.close()

    asyncio.run(scenario())


def test_a_failing_handler_answers_its_error_and_the_channel_serves_on() -> None:
    async def scenario() -> None:
        server, path = await served(Source())
        channel = await PeerChannel.connect(path)
        with pytest.raises(ChannelError, match="unlucky hash"):
            await channel.call(ChannelOp.PIN, [1, 13])
        assert not channel.broken
        assert await channel.call(ChannelOp.PIN, [1]) == [100]
        channel.close()
        server.close()

    asyncio.run(scenario())


def test_garbage_drops_only_that_connection() -> None:
    async def scenario() -> None:
        server, path = await served(Source())
        good = await PeerChannel.connect(path)
        reader, writer = await asyncio.open_unix_connection(path)
        writer.write(bytes([99, 0, 0, 0, 0, 1, 0, 0, 0]))  # op 99 does not exist
        await writer.drain()
        assert await reader.read() == b""  # the source hung up on it
        assert await good.call(ChannelOp.PIN, [4, 5]) == [100, 101]
        good.close()
        server.close()

    asyncio.run(scenario())


def test_a_source_that_went_away_leaves_a_broken_channel() -> None:
    async def scenario() -> None:
        path = os.path.join(tempfile.mkdtemp(), "dead.sock")

        async def hang_up(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.close()  # a worker that died between accepting and answering

        server = await asyncio.start_unix_server(hang_up, path)
        channel = await PeerChannel.connect(path)
        with pytest.raises(ChannelError, match="broke"):
            await channel.call(ChannelOp.PIN, [1])
        assert channel.broken
        with pytest.raises(ChannelError, match="closed"):
            await channel.call(ChannelOp.PIN, [1])
        server.close()

    asyncio.run(scenario())


def test_the_blocking_end_gets_the_same_answers_for_one_owner_at_a_time() -> None:
    async def scenario() -> None:
        server, path = await served(Source())
        channel = BlockingChannel(path)
        assert channel.try_take() and not channel.try_take()

        def ask(values: list[int]) -> list[int] | None:
            channel.send(ChannelOp.PIN, values)
            assert channel.answered_within(5.0)
            return channel.receive()

        big = [2**64 - 1 - i for i in range(480)]
        assert await asyncio.to_thread(ask, big) == [100 + i for i in range(480)]
        with pytest.raises(ChannelError, match="unlucky hash"):
            await asyncio.to_thread(ask, [1, 13])
        assert not channel.broken  # an error answer leaves the channel usable
        assert await asyncio.to_thread(ask, [1]) == [100]
        channel.give_back()
        assert channel.try_take()
        closing = BlockingChannel(path)
        closing._sock.close()  # closed by another thread between the check and the wait
        with pytest.raises(ChannelError, match="broke"):
            closing.answered_within(0.01)
        assert closing.broken
        channel.close()
        assert channel.broken and not channel.try_take()
        with pytest.raises(ChannelError, match="closed"):
            channel.send(ChannelOp.PIN, [1])
        server.close()

    asyncio.run(scenario())
