"""Admission limits of the gRPC server: a per-client rate and a cap on concurrent streams.

Pure and thread-safe; the clock is an argument so tests are deterministic. The interceptor
(`service/interceptor.py`) asks before each call and answers RESOURCE_EXHAUSTED on a refusal.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

Clock = Callable[[], float]


@dataclass(slots=True)
class _Bucket:
    tokens: float
    updated_s: float


class RateLimiter:
    """A token bucket per client: `rate_per_s` calls per second on average, `burst` at once.

    Invariants: 0 <= tokens <= burst in every bucket; at most `max_clients` buckets are kept.
    Eviction never resets a limit: only a bucket that has refilled to `burst` may be dropped
    (a new bucket for that client starts full, exactly what it had). When every bucket is still
    limiting its client, a client without a bucket shares the one overflow bucket, so many
    distinct peers can neither grow memory nor get a fresh burst each.
    """

    OVERFLOW = "\x00overflow"
    EVICTION_SCAN = 64

    def __init__(
        self,
        rate_per_s: float,
        burst: int,
        *,
        clock: Clock = time.monotonic,
        max_clients: int = 10_000,
    ) -> None:
        if not rate_per_s > 0:
            raise ValueError(f"rate_per_s must be > 0, got {rate_per_s}")
        if burst < 1:
            raise ValueError(f"burst must be >= 1, got {burst}")
        if max_clients < 2:
            raise ValueError(f"max_clients must be >= 2, got {max_clients}")
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._clock = clock
        self._max_clients = max_clients
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()
        self._lock = threading.Lock()

    def allow(self, client: str) -> bool:
        """Take one token from `client`'s bucket; False when it is empty (refuse the call)."""
        now = self._clock()
        with self._lock:
            bucket = self._bucket(client, now)
            if bucket.tokens < 1.0:
                return False
            bucket.tokens -= 1.0
            return True

    def _bucket(self, client: str, now: float) -> _Bucket:
        bucket = self._buckets.get(client)
        if bucket is None and len(self._buckets) >= self._max_clients:
            self._drop_full_buckets(now)
            if len(self._buckets) >= self._max_clients:
                client = self.OVERFLOW
                bucket = self._buckets.get(client)
        if bucket is None:
            bucket = _Bucket(float(self.burst), now)
            self._buckets[client] = bucket
            if len(self._buckets) > self._max_clients:  # only the overflow bucket itself
                self._drop_full_buckets(now, keep=client)
        self._buckets.move_to_end(client)
        self._refill(bucket, now)
        return bucket

    def _refill(self, bucket: _Bucket, now: float) -> None:
        elapsed = max(0.0, now - bucket.updated_s)
        bucket.tokens = min(float(self.burst), bucket.tokens + elapsed * self.rate_per_s)
        bucket.updated_s = now

    def _drop_full_buckets(self, now: float, keep: str = "") -> None:
        """Drop refilled buckets among the least recently seen (a bounded scan): dropping one
        changes nothing for its client."""
        for client in list(self._buckets)[: self.EVICTION_SCAN]:
            bucket = self._buckets[client]
            self._refill(bucket, now)
            if bucket.tokens >= self.burst and client != keep:
                del self._buckets[client]

    @property
    def num_clients(self) -> int:
        with self._lock:
            return len(self._buckets)

    def check_invariants(self) -> None:
        with self._lock:
            assert len(self._buckets) <= self._max_clients + 1  # + the overflow bucket
            for b in self._buckets.values():
                assert 0.0 <= b.tokens <= self.burst, b


class StreamSlots:
    """A non-blocking counting semaphore: `try_acquire` answers at once, never queues.

    Invariant: 0 <= num_active <= capacity.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._active = 0
        self._lock = threading.Lock()

    @property
    def num_active(self) -> int:
        return self._active

    def try_acquire(self) -> bool:
        with self._lock:
            if self._active >= self.capacity:
                return False
            self._active += 1
            return True

    def release(self) -> None:
        with self._lock:
            if self._active <= 0:
                raise ValueError("release() without a matching try_acquire()")
            self._active -= 1


class SendWatch:
    """When each stream last handed a response to gRPC that has not been sent yet.

    A server stream's send completes once the client's flow-control window takes the bytes, so
    a response still unsent after `budget_s` means the client stopped reading: that stream is
    `overdue`. Time spent producing the next response (the model decoding) never counts.
    Invariant: a stream is tracked iff it has a response in flight.
    """

    def __init__(self, budget_s: float, *, clock: Clock = time.monotonic) -> None:
        if not budget_s > 0:
            raise ValueError(f"budget_s must be > 0, got {budget_s}")
        self.budget_s = budget_s
        self._clock = clock
        self._sending_since: dict[int, float] = {}
        self._lock = threading.Lock()

    def sending(self, stream: int) -> None:
        """`stream` handed a response to gRPC."""
        with self._lock:
            self._sending_since[stream] = self._clock()

    def sent(self, stream: int) -> None:
        """`stream`'s response went out (gRPC asked for the next one), or the stream ended."""
        with self._lock:
            self._sending_since.pop(stream, None)

    def overdue(self) -> list[int]:
        """Streams whose response has waited longer than the budget, oldest first."""
        now = self._clock()
        with self._lock:
            late = [(t, s) for s, t in self._sending_since.items() if now - t > self.budget_s]
        return [s for _t, s in sorted(late)]

    @property
    def num_sending(self) -> int:
        with self._lock:
            return len(self._sending_since)
