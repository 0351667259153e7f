"""Feeds one external engine's KV events into kvmesh's index, as if the engine were a worker.

    engine batch ─> ChainTranslator ─> kvmesh EventBatch(worker=engine id, generation, seq)
                                   ─> EventPublisher (the same Redis script a worker uses)

So the Redis keys, the event stream, every coordinator's mirror, replicas and `kvmesh index
verify` treat the engine like any worker. `seq` counts kvmesh batches from 1 per generation;
a new generation (start, a reset of the engine's stream, Redis losing the engine's entries)
makes every follower reload the engine's set.

Several coordinators may subscribe to one engine, but only one *feeds* it at a time (two
feeders would wipe each other's generations): each keeps its translator current, and the one
holding the engine's claim in Redis publishes (`keep_claim`, renewed with every heartbeat). A
coordinator that takes the claim over publishes everything its translator holds under a new
generation first.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvmesh.coordinator.engines.chain_translator import ChainTranslator
from kvmesh.coordinator.engines.engine_events import EngineEventBatch
from kvmesh.proto.events import AllCleared, EventBatch, KVEvent
from kvmesh.workers.engine.event_publisher import EventPublisher

log = logging.getLogger(__name__)


class EngineIndexFeed:
    """Invariant: `seq` is the last batch published in `generation` (0: none yet)."""

    def __init__(
        self,
        engine_id: str,
        translator: ChainTranslator,
        publisher: EventPublisher,
        *,
        clock_ms: Callable[[], int] = lambda: int(time.time() * 1000),
        feeding: bool = True,
    ) -> None:
        """`feeding` False: translate but publish nothing until `keep_claim` wins the claim."""
        self.engine_id = engine_id
        self.translator = translator
        self.publisher = publisher
        self._clock_ms = clock_ms
        self._lock = threading.Lock()
        self.generation = clock_ms()  # unique across this engine's feeds (restarts included)
        self.seq = 0
        self.closed = False
        self.feeding = feeding
        self.num_batches = 0
        self.num_events = 0

    def on_batch(self, batch: EngineEventBatch) -> None:
        """An engine batch in, at most one kvmesh batch out (nothing when no block changed)."""
        with self._lock:
            if self.closed:
                return
            events = [e for e in map(self.translator.translate, batch.events) if e is not None]
            self.num_batches += 1
            self.num_events += len(batch.events)
            # After a failed publish, nothing more until a heartbeat has re-checked the claim and
            # re-published in full: a feeder that lost its claim while Redis was away must not
            # wipe its successor's state with a batch of its old generation.
            if events and self.feeding and not self.publisher.lost_events:
                self._publish(events)

    def on_reset(self, reason: str) -> None:
        """The engine's state is unknown: drop its entries (a new generation wipes them)."""
        with self._lock:
            if self.closed:
                return
            self.translator.clear()
            if self.feeding and not self.publisher.lost_events:
                self.generation = max(self.generation + 1, self._clock_ms())
                self.seq = 0
                self._publish([AllCleared()])

    def republish_if_lost(self) -> None:
        """After Redis lost this engine's entries (restarted empty, or purged while the engine
        lived on), publish everything the translator knows under a new generation."""
        with self._lock:
            if self.closed or not self.feeding or not self.publisher.lost_events:
                return
            self._publish_all()

    def keep_claim(self, owner: str, ttl_ms: int) -> bool:
        """Take or renew this engine's claim for `owner` (one coordinator feeds an engine);
        returns whether this feed publishes now. Winning the claim publishes the whole state
        under a new generation; losing it stops publishing."""
        won = self.publisher.claim_feed(owner, ttl_ms)
        with self._lock:
            if self.closed:
                return False
            if won and not self.feeding:
                self.feeding = True
                self._publish_all()
            elif not won and self.feeding and self.publisher.connected:
                self.feeding = False  # another coordinator holds the claim
        self.republish_if_lost()
        return won

    def _publish_all(self) -> None:
        self.generation = max(self.generation + 1, self._clock_ms())
        self.seq = 0
        events: list[KVEvent] = [AllCleared(), *self.translator.held()]
        if self._publish(events):
            self.publisher.lost_events = False
        else:
            self.publisher.lost_events = True

    def held_hashes(self) -> list[int]:
        """The kvmesh hashes of every block the engine holds, as far as its events said."""
        with self._lock:
            return sorted({int(h) for e in self.translator.held() for h in e.hashes})

    def close(self) -> None:
        """No more publishing (the engine is gone and about to be purged)."""
        with self._lock:
            self.closed = True

    def _publish(self, events: list[KVEvent]) -> bool:
        self.seq += 1
        batch = EventBatch(
            self.engine_id, self.generation, self.seq, tuple(events), self._clock_ms()
        )
        result = self.publisher.publish(batch)
        if not result.ok:
            # Redis is away: the next heartbeat that finds it back re-publishes in full.
            self.seq -= 1
        return result.ok
