"""Writes into the paged cache that land layer by layer on a side stream (CUDA), so the forward
that reads them waits for layer l only just before layer l's attention, and the copy of the later
layers overlaps the compute of the earlier ones.

    side stream:  [ layers 0-3 ]e0 [ layers 4-7 ]e1 ... [ layers 28-31 ]e7
    forward:           wait e0 -> layer 0 .. 3, wait e1 -> layer 4 .. 7, ...

Two kinds feed the model runner this way: a promotion from the pinned host tier (`LayerLoad`,
one event per layer) and a pull from a peer, over NCCL or CUDA IPC, moved in layer groups
(`LayerGroups`). Both record the runner's layer gates as their layers land (`layer_gates.py`), so
a prefill replayed as a CUDA graph waits for them layer by layer too, not for all of them before
the replay. The runner keeps them until the end of the step that follows; anything that hands
their blocks to a peer settles them first, and a copy out of the cache waits for them
(`BlockIO.settle_layer_writes`, `export_blocks`): the blocks are registered before their
layers land.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch

from kvmesh.workers.kv.layer_gates import LayerGates


class LayerWrites(Protocol):
    """Invariant: layer l of every target block (`blocks`) is written once the current stream
    has waited in `wait_layer(l)`; all of it once `done` has completed."""

    blocks: frozenset[int]
    overlaps_forward: bool
    """True: a copy about as long as the forward that reads it (the host tier over PCIe): a
    forward waits layer by layer, never for all of it first. False: a short copy (a pull from a
    peer GPU): a forward may wait for all of it up front where it has no gates to wait on."""
    gated: bool
    """True: it records the runner's `LayerGates` too, so a captured prefill graph waits on it
    layer by layer and nothing need wait for it before a replay."""

    @property
    def done(self) -> torch.cuda.Event: ...

    def wait_layer(self, layer: int) -> None: ...

    def wait_all(self) -> None: ...


def group_spans(num_layers: int, num_groups: int) -> list[tuple[int, int]]:
    """[lo, hi) layer ranges splitting `num_layers` into at most `num_groups` near-equal groups;
    both sides of a transfer compute the same groups from the same counts.

        group_spans(10, 4) -> [(0, 2), (2, 5), (5, 8), (8, 10)]
    """
    if num_layers < 0 or num_groups < 1:
        raise ValueError(f"{num_layers} layers in {num_groups} groups")
    k = min(num_groups, num_layers)
    bounds = [round(i * num_layers / k) for i in range(k + 1)] if k else [0]
    return [(bounds[i], bounds[i + 1]) for i in range(k)]


class LayerGroups:
    """A write run as one step per layer group on `stream`, each recording its group's event.

    `write_group(lo, hi)` enqueues the writes of layers [lo, hi) into `blocks` on the current
    (side) stream;
    whatever it returns (received buffers, staging) is kept until `done` has completed, so the
    caching allocator cannot hand that memory out while the GPU still reads or writes it.
    With `gates` (the runner's), each group also records the gates of its layers, so a prefill
    graph starts once the first group has landed; `stream` must then be the runner's layer
    stream, in whose order every gated write runs (a host-tier load's second stream included:
    `LayerLoad`), so that a gate's latest record comes after every write enqueued before it.
    Invariant: `_event_of[l]` is the event of the group holding layer l.
    """

    def __init__(
        self,
        spans: list[tuple[int, int]],
        stream: torch.cuda.Stream,
        blocks: Iterable[int],
        write_group: Callable[[int, int], Any],
        gates: LayerGates | None = None,
    ) -> None:
        if not spans:
            raise ValueError("a layered write needs at least one layer group")
        if gates is not None and spans[-1][1] > gates.num_layers:
            raise ValueError(f"{gates.num_layers} layer gates for layers up to {spans[-1][1]}")
        self.blocks = frozenset(int(b) for b in blocks)
        self.overlaps_forward = False  # a peer's pull: ~1-3 ms for 1 GB
        self.gated = gates is not None
        self._event_of: dict[int, torch.cuda.Event] = {}
        self._events: list[torch.cuda.Event] = []
        self._kept: list[Any] = []
        # The target blocks were just reserved: whatever the main stream still does with them
        # (a demotion copying their old contents out) must finish before they are overwritten.
        stream.wait_stream(torch.cuda.current_stream(stream.device))
        with torch.cuda.stream(stream):
            for lo, hi in spans:
                self._kept.append(write_group(lo, hi))
                event = torch.cuda.Event()
                event.record(stream)
                self._events.append(event)
                for layer in range(lo, hi):
                    self._event_of[layer] = event
                    if gates is not None:
                        gates.record(layer, stream)

    @property
    def done(self) -> torch.cuda.Event:
        return self._events[-1]

    def wait_layer(self, layer: int) -> None:
        event = self._event_of.get(layer)
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def wait_all(self) -> None:
        torch.cuda.current_stream().wait_event(self.done)


async def until_done(event: torch.cuda.Event, poll_s: float = 0.0005) -> None:
    """Wait, without holding the event loop, for the GPU to pass `event`."""
    while not event.query():
        await asyncio.sleep(poll_s)
