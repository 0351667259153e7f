"""Blocks set aside for a pull, owned by the request that will use them.

A pull is part of its request's allocation (the way an engine counts externally computed tokens
as the request's own): when the worker accepts a request with a pull plan, it pins what it
already holds of the chain and allocates fresh blocks for the rest, before anything is moved.

    chain:     [0 ..... held) [held ............. end)
    blocks:     pinned local    reserved: written by the transport, then registered in order

`commit` registers the blocks the transport wrote and turns the reservation's references on the
local run and the written blocks into the request's pin (released when the scheduler admits it);
the unwritten blocks go back. Nothing matched or pulled is ever unpinned before it is used.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.proto.block_hash import BlockHash
from kvmesh.workers.kv.block_pool import BlockId, BlockPool


@dataclass(frozen=True, slots=True)
class PullReservation:
    """Invariant: `local` and `targets` each hold one reference taken by `reserve`, and
    `len(targets) == len(hashes)`; `hashes[0]`'s parent is `parent`."""

    local: tuple[BlockId, ...]
    """The leading run of the chain this worker already held (pinned)."""
    targets: tuple[BlockId, ...]
    """Fresh, unregistered blocks the transport writes into, in chain order."""
    hashes: tuple[BlockHash, ...]
    """Chain hashes the targets will hold."""
    parent: BlockHash
    """Hash before `hashes[0]` (the last local block's, or the namespace root)."""


def reserve(
    pool: BlockPool, chain: Sequence[BlockHash], end_block: int, root: BlockHash, headroom: int
) -> PullReservation | None:
    """Pin the held prefix of `chain[:end_block]` and allocate blocks for the rest, keeping
    `headroom` blocks free for the request's own suffix. None when nothing is left to move."""
    local = pool.match_prefix(chain[:end_block])
    pool.acquire(local)
    num_wanted = end_block - len(local)
    num_targets = max(0, min(num_wanted, pool.num_free - headroom))
    targets = pool.allocate(num_targets) if num_targets else []
    if not targets:
        pool.free(local)
        return None
    held = len(local)
    parent = chain[held - 1] if held else root
    return PullReservation(
        tuple(local), tuple(targets), tuple(chain[held : held + len(targets)]), parent
    )


def commit(
    pool: BlockPool, reservation: PullReservation, num_written: int, chain: Sequence[BlockHash]
) -> tuple[list[BlockId], int]:
    """Register the first `num_written` targets and pin the prefix of `chain` the pool now holds
    (the reservation's own references, when every written block registered; otherwise fresh
    ones, the reservation released). Returns (pinned blocks, how many pulled blocks they
    include)."""
    if not 0 <= num_written <= len(reservation.targets):
        raise ValueError(
            f"{num_written} blocks written into a reservation of {len(reservation.targets)}"
        )
    depth = len(reservation.local) + 1  # hashes[0] follows the local run
    written = reservation.targets[:num_written]
    hashes = reservation.hashes[:num_written]
    if pool.register_run(written, hashes, reservation.parent, depth):
        # The common case: the prefix the pool now holds is exactly the local run and the
        # written blocks, and the reservation's references on them become the request's pin.
        pool.free(reservation.targets[num_written:])
        return [*reservation.local, *written], num_written
    pinned = pool.match_prefix(chain)
    pool.acquire(pinned)
    release(pool, reservation)
    return pinned, len(set(pinned).intersection(written))


def release(pool: BlockPool, reservation: PullReservation) -> None:
    """Drop the reservation's references; unwritten targets go back unregistered."""
    pool.free(list(reservation.local) + list(reservation.targets))
