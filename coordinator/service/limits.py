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

    Invariants: 0 <= tokens <= burst in every bucket; at most `max_clients` buckets are kept
    (the least recently seen are dropped first: a dropped client starts again with a full
    bucket, which only ever errs towards admitting), so many distinct peers cannot grow memory.
    """

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
            bucket = self._buckets.get(client)
            if bucket is None:
                bucket = _Bucket(float(self.burst), now)
                self._buckets[client] = bucket
                if len(self._buckets) > self._max_clients:
                    self._buckets.popitem(last=False)
            else:
                self._buckets.move_to_end(client)
                elapsed = max(0.0, now - bucket.updated_s)
                bucket.tokens = min(float(self.burst), bucket.tokens + elapsed * self.rate_per_s)
                bucket.updated_s = now
            if bucket.tokens < 1.0:
                return False
            bucket.tokens -= 1.0
            return True

    @property
    def num_clients(self) -> int:
        with self._lock:
            return len(self._buckets)

    def check_invariants(self) -> None:
        with self._lock:
            assert len(self._buckets) <= self._max_clients
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
