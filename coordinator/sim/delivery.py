"""Tokens on their way from a simulated worker to the client, through the coordinator.

A live worker hands each token to its coordinator's output stream; the coordinator and gRPC do
some work per token for every stream they carry, so a coordinator with n streams in flight gets
a token of each through every `delivery_ms(n)` (`SimCostModel`), and a token spends at least that
on the way. This delays the client's tokens and takes no worker time. For one stream, with the
worker making token k at t_k and d = delivery_ms(streams in flight):

    client_1 = t_1 + d                                   the first token, d at that moment
    client_k = max(t_k, client_(k-1)) + d                each later one (a FIFO per stream)
    client_n >= max(t_n + d, client_1 + (n - 1) * d)     k = n and k = 1 of the unrolled max

The simulation knows only t_1 and t_n (decode runs are timed in closed form), so the last token
is priced by the bound, which is exact when the worker's gaps are all at least d (delivery keeps
up: client_n = t_n + d) or all at most d (delivery sets the pace); d for the rest of the stream
is taken at the mean number of streams in flight between its first and last token.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.coordinator.sim.cost_model import SimCostModel


@dataclass(frozen=True, slots=True)
class OpenStream:
    """A stream whose first token has reached the client."""

    coordinator: int
    first_token_ms: float
    """When the worker made the first token."""
    client_first_ms: float
    """When the client saw it."""
    stream_ms_at_open: float
    """Its coordinator's stream-milliseconds (streams x time, summed) when it opened."""


class StreamDelivery:
    """Streams in flight per coordinator and the client's token times they give.

    Invariants (checked by `check_invariants`):
      * num_streams[k] == the open streams routed by coordinator k
      * stream_ms[k] only grows, and is up to date at updated_ms[k]
    """

    def __init__(self, cost: SimCostModel, num_coordinators: int) -> None:
        if num_coordinators < 1:
            raise ValueError(f"need >= 1 coordinator, got {num_coordinators}")
        self.cost = cost
        self.num_streams = [0] * num_coordinators
        self.stream_ms = [0.0] * num_coordinators
        self.updated_ms = [0.0] * num_coordinators
        self._open: dict[int, OpenStream] = {}

    def _advance(self, coordinator: int, now_ms: float) -> None:
        elapsed = now_ms - self.updated_ms[coordinator]
        if elapsed > 0:
            self.stream_ms[coordinator] += self.num_streams[coordinator] * elapsed
            self.updated_ms[coordinator] = now_ms

    def open(self, key: int, coordinator: int, now_ms: float) -> float:
        """The worker made stream `key`'s first token at `now_ms`: when the client sees it."""
        if key in self._open:
            raise ValueError(f"stream {key} is already open")
        self._advance(coordinator, now_ms)
        self.num_streams[coordinator] += 1
        client_ms = now_ms + self.cost.delivery_ms(self.num_streams[coordinator])
        self._open[key] = OpenStream(coordinator, now_ms, client_ms, self.stream_ms[coordinator])
        return client_ms

    def close(self, key: int, now_ms: float, num_tokens: int) -> tuple[float, float]:
        """The worker made stream `key`'s last token (of `num_tokens`) at `now_ms`: when the
        client saw the first and sees the last."""
        stream = self._open.pop(key)
        k = stream.coordinator
        self._advance(k, now_ms)
        elapsed = now_ms - stream.first_token_ms
        if elapsed > 0:
            mean_streams = (self.stream_ms[k] - stream.stream_ms_at_open) / elapsed
        else:
            mean_streams = self.num_streams[k]
        self.num_streams[k] -= 1
        d = self.cost.delivery_ms(mean_streams)
        last_ms = max(now_ms + d, stream.client_first_ms + (num_tokens - 1) * d)
        return stream.client_first_ms, last_ms

    def check_invariants(self) -> None:
        for k, n in enumerate(self.num_streams):
            assert n == sum(1 for s in self._open.values() if s.coordinator == k), (k, n)
            assert self.stream_ms[k] >= 0.0
