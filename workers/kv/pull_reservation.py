"""Blocks set aside for a pull, owned by the request that will use them.

A pull is part of its request's allocation (the way an engine counts externally computed tokens
as the request's own): when the worker accepts a request with a pull plan, it pins what it
already holds of the chain and allocates fresh blocks for the rest, before anything is moved.

    chain:     [0 ..... held) [held ............. end)
    blocks:     pinned local    reserved: written by the transport, then registered in order

`commit` registers the blocks the transport wrote, takes one reference on the whole prefix the
pool now holds (the request's pin, released when the scheduler admits it) and drops the
reservation's own references. Nothing matched or pulled is ever unpinned before it is used.
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
    """Register the first `num_written` targets, pin the prefix of `chain` the pool now holds
    and release the reservation. Returns (pinned blocks, how many pulled blocks they include)."""
    if not 0 <= num_written <= len(reservation.targets):
        raise ValueError(
            f"{num_written} blocks written into a reservation of {len(reservation.targets)}"
        )
    parent = reservation.parent
    depth = len(reservation.local) + 1  # hashes[0] follows the local run
    for block, h in zip(reservation.targets[:num_written], reservation.hashes, strict=False):
        pool.register(block, h, parent, depth=depth)
        parent, depth = h, depth + 1
    pinned = pool.match_prefix(chain)
    pool.acquire(pinned)
    release(pool, reservation)
    num_pulled = max(0, min(len(pinned) - len(reservation.local), num_written))
    return pinned, num_pulled


def release(pool: BlockPool, reservation: PullReservation) -> None:
    """Drop the reservation's references; unwritten targets go back unregistered."""
    pool.free(list(reservation.local) + list(reservation.targets))
