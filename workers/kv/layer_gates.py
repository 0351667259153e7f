"""One CUDA event per layer that every layer load records as that layer lands, so a captured
prefill graph can wait on a promotion still landing (CUDA).

A graph cannot wait on a load's own events: they are new for every load, and an event recorded
outside a capture is invisible to it. These events are made once, as external events: a capture
turns each wait into a wait node on the event itself, and every replay waits for the event's
latest record. So a host hit replays the graph a local hit replays, its layer l waiting for the
promotion's layer l, and a replay with nothing landing passes straight through (the latest
records long complete).

    load (side streams):  layer 0 ... gate[0]   layer 1 ... gate[1]   ...
    graph replay:         wait gate[0] -> layer 0, wait gate[1] -> layer 1, ...
"""

from __future__ import annotations

import torch


class LayerGates:
    """Invariants: every gate has been recorded at least once (so a capture waits on it; an
    event never recorded would be skipped); a gate is re-recorded only after every replay that
    waited on its earlier record has completed (the engine samples each step on the host
    before the next step starts its loads)."""

    def __init__(self, num_layers: int, device: torch.device) -> None:
        if num_layers <= 0:
            raise ValueError(f"num_layers must be positive, got {num_layers}")
        self._events = [torch.cuda.Event(external=True) for _ in range(num_layers)]
        stream = torch.cuda.current_stream(device)
        for event in self._events:
            event.record(stream)

    @staticmethod
    def usable() -> bool:
        """Whether this torch makes external events (graph captures then wait on the gates)."""
        try:
            torch.cuda.Event(external=True)
        except TypeError:
            return False
        return True

    @property
    def num_layers(self) -> int:
        return len(self._events)

    def record(self, layer: int, stream: torch.cuda.Stream) -> None:
        """`layer` of the load on `stream` has landed once `stream` gets here."""
        self._events[layer].record(stream)

    def wait(self, layer: int) -> None:
        """The current stream (a capture's, as a wait node) waits for `layer`'s latest record."""
        torch.cuda.current_stream().wait_event(self._events[layer])
