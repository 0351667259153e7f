"""Which transport a planned pull runs on: the planned device link or recompute, the object store
only when the plan named it."""

from __future__ import annotations

import asyncio

from kvmesh.proto.block_hash import BlockHash
from kvmesh.workers.transfer.transport import WriteOnEngine, fetch_planned


class Recording:
    """A transport that answers `result` and remembers that it was asked."""

    def __init__(self, result: int | None) -> None:
        self.result = result
        self.calls = 0

    async def fetch(
        self, source: str, hashes: tuple[BlockHash, ...], write: WriteOnEngine
    ) -> int | None:
        self.calls += 1
        return self.result


async def never_write(fill: object) -> int:
    raise AssertionError("no transport here writes")


def fetch(planned: Recording | None, store: Recording) -> int:
    hashes = (BlockHash(1), BlockHash(2))
    return asyncio.run(fetch_planned(planned, store, "w1", hashes, never_write))


def test_a_planned_device_link_moves_the_blocks_and_the_store_is_not_asked() -> None:
    link, store = Recording(2), Recording(2)
    assert fetch(link, store) == 2
    assert (link.calls, store.calls) == (1, 0)


def test_a_busy_device_link_means_recompute_not_the_object_store() -> None:
    link, store = Recording(None), Recording(2)
    assert fetch(link, store) == 0
    assert (link.calls, store.calls) == (1, 0)


def test_a_pull_planned_over_the_object_store_uses_it() -> None:
    store = Recording(2)
    assert fetch(None, store) == 2
    assert store.calls == 1
    assert fetch(None, Recording(None)) == 0
