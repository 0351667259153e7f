"""The external engines a coordinator routes to: each one's event subscriber, index feed,
health check and heartbeat, and its place in the worker registry.

    start:    registry.add(id) -> subscribe to its KV events (replaying what it buffers)
    health:   GET {base_url}/health every interval; while it answers, the engine's heartbeat in
              Redis is renewed (so followers keep its entries); `max_failures` misses in a row,
              or a refused connection while proxying, and the engine is down
    down:     stop its feed (nothing more is published) -> registry.mark_dead -> the registry's
              listeners purge its entries from Redis and every mirror, and drop its load

A dead engine stays dead under its id (the registry's rule); restart the coordinator, or give
the restarted engine a new id, to route to it again.
"""

from __future__ import annotations

import http.client
import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvmesh.coordinator.cluster.registry import WorkerRegistry
from kvmesh.coordinator.engines import sglang_events, vllm_events
from kvmesh.coordinator.engines.chain_translator import ChainTranslator
from kvmesh.coordinator.engines.engine_backend import EngineEndpoint
from kvmesh.coordinator.engines.engine_events import EngineEventBatch
from kvmesh.coordinator.engines.event_subscriber import EngineEventSubscriber, SubscriberConfig
from kvmesh.coordinator.engines.index_feed import EngineIndexFeed
from kvmesh.proto.block_hash import BlockHash, namespace_hash
from kvmesh.workers.engine.event_publisher import EventPublisher

log = logging.getLogger(__name__)

DECODERS: dict[str, Callable[[bytes], EngineEventBatch]] = {
    "vllm": vllm_events.decode_payload,
    "sglang": sglang_events.decode_payload,
}


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """One external engine, as given on the command line:
    `ID,BASE_URL,EVENTS_ENDPOINT[,REPLAY_ENDPOINT[,KIND]]`."""

    engine_id: str
    base_url: str
    events_endpoint: str
    replay_endpoint: str = ""
    kind: str = "vllm"
    """Its event schema: vllm or sglang."""
    topic: str = ""

    def __post_init__(self) -> None:
        if not self.engine_id or "," in self.engine_id:
            raise ValueError(f"an engine id must be non-empty without commas: {self.engine_id!r}")
        if urlsplit(self.base_url).scheme not in ("http", "https"):
            raise ValueError(f"engine {self.engine_id}: base URL must be http(s)://, got"
                             f" {self.base_url!r}")  # fmt: skip
        for name, endpoint in (("events", self.events_endpoint), ("replay", self.replay_endpoint)):
            if endpoint and "://" not in endpoint:
                raise ValueError(f"engine {self.engine_id}: {name} endpoint must look like"
                                 f" tcp://host:port, got {endpoint!r}")  # fmt: skip
        if not self.events_endpoint:
            raise ValueError(f"engine {self.engine_id}: a KV-event endpoint is required")
        if self.kind not in DECODERS:
            raise ValueError(f"engine {self.engine_id}: kind must be one of {sorted(DECODERS)},"
                             f" got {self.kind!r}")  # fmt: skip

    @classmethod
    def parse(cls, text: str) -> EngineSpec:
        parts = [p.strip() for p in text.split(",")]
        if not 3 <= len(parts) <= 5:
            raise ValueError(
                f"--engine takes ID,BASE_URL,EVENTS_ENDPOINT[,REPLAY_ENDPOINT[,KIND]], got {text!r}"
            )
        return cls(*parts)


@dataclass(frozen=True, slots=True)
class EngineFleetConfig:
    health_interval_s: float = 2.0
    """How often each engine's `/health` is asked (and its heartbeat renewed)."""
    max_failures: int = 3
    """Failed health checks in a row that make an engine down."""
    heartbeat_ttl_s: float = 10.0
    """Lifetime of an engine's heartbeat in Redis (followers purge it when it lapses)."""

    def __post_init__(self) -> None:
        if self.max_failures < 1:
            raise ValueError(f"max_failures must be >= 1, got {self.max_failures}")
        if not 0 < self.health_interval_s < self.heartbeat_ttl_s:
            raise ValueError(f"need 0 < health_interval_s ({self.health_interval_s}) <"
                             f" heartbeat_ttl_s ({self.heartbeat_ttl_s})")  # fmt: skip


@dataclass(slots=True)
class _Engine:
    spec: EngineSpec
    feed: EngineIndexFeed
    subscriber: EngineEventSubscriber
    num_failures: int = 0
    down: bool = False


_STREAM_COUNTERS = (
    "num_batches",
    "num_replayed_batches",
    "num_gaps",
    "num_resets",
    "num_undecodable",
    "num_skipped_events",
)


class EngineFleet:
    """Invariant: every engine here is known to the registry; a down engine's feed is closed."""

    def __init__(
        self,
        specs: Sequence[EngineSpec],
        config: EngineFleetConfig,
        registry: WorkerRegistry,
        redis_url: str,
        *,
        block_size: int,
        model_fingerprint: str,
        root: Callable[[str, str], BlockHash],
    ) -> None:
        """`block_size`: the engines' KV block size, which is the coordinator's; `root(lora,
        salt)`: the coordinator's h_0 for them (the chains of prompts and of announced blocks
        must agree)."""
        ids = [s.engine_id for s in specs]
        if len(set(ids)) != len(ids):
            raise ValueError(f"engine ids must be unique, got {ids}")
        self.config = config
        self.block_size = block_size
        self.registry = registry
        self.ns = f"{namespace_hash(model_fingerprint):016x}"
        self._root = root
        self._engines: dict[str, _Engine] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Which coordinator feeds an engine's events (one at a time, see `index_feed`).
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        for spec in specs:
            self._engines[spec.engine_id] = self._make(spec, redis_url)

    def _make(self, spec: EngineSpec, redis_url: str) -> _Engine:
        translator = ChainTranslator(self.block_size, self._root)
        publisher = EventPublisher(redis_url, self.ns, spec.engine_id)
        feed = EngineIndexFeed(spec.engine_id, translator, publisher, feeding=False)
        subscriber = EngineEventSubscriber(
            SubscriberConfig(spec.events_endpoint, spec.replay_endpoint, spec.topic),
            DECODERS[spec.kind],
            feed.on_batch,
            feed.on_reset,
            name=spec.engine_id,
        )
        return _Engine(spec, feed, subscriber)

    # ---- reads --------------------------------------------------------------------------------

    def endpoints(self) -> dict[str, EngineEndpoint]:
        return {e: EngineEndpoint(e, x.spec.base_url) for e, x in self._engines.items()}

    def kind(self, worker_id: str) -> str:
        """`vllm` / `sglang` for an engine, `kvmesh` for any other worker."""
        engine = self._engines.get(worker_id)
        return engine.spec.kind if engine is not None else "kvmesh"

    def spec(self, engine_id: str) -> EngineSpec | None:
        engine = self._engines.get(engine_id)
        return engine.spec if engine is not None else None

    def feed(self, engine_id: str) -> EngineIndexFeed:
        return self._engines[engine_id].feed

    def subscriber(self, engine_id: str) -> EngineEventSubscriber:
        return self._engines[engine_id].subscriber

    def stream_counts(self) -> dict[str, dict[str, int]]:
        """Per engine, what its event stream brought: batches, replayed batches, gaps, resets,
        undecodable payloads, skipped events (the subscriber's counters, by name)."""
        return {
            engine_id: {
                name.removeprefix("num_"): int(getattr(engine.subscriber.counters, name))
                for name in _STREAM_COUNTERS
            }
            for engine_id, engine in self._engines.items()
        }

    def announced(self) -> dict[str, list[int]]:
        """Per live engine, the kvmesh hashes of the blocks it announced and still holds."""
        return {
            engine_id: engine.feed.held_hashes()
            for engine_id, engine in self._engines.items()
            if not engine.down
        }

    # ---- life ---------------------------------------------------------------------------------

    def start(self) -> None:
        for engine_id, engine in self._engines.items():
            self.registry.add(engine_id)
            engine.subscriber.start()
            self._heartbeat(engine)  # a follower must not find it lapsed before the first check
        self._thread = threading.Thread(target=self._watch, name="kvmesh-engines", daemon=True)
        self._thread.start()

    def mark_down(self, engine_id: str, why: str) -> None:
        """The engine is gone: publish nothing more for it, then tell the registry (whose
        listeners purge its index entries and forget its load)."""
        with self._lock:
            engine = self._engines.get(engine_id)
            if engine is None or engine.down:
                return
            engine.down = True
        engine.feed.close()
        self.registry.mark_dead(engine_id, why)

    def check_once(self) -> None:
        """One round of health checks (the watch loop's body; tests call it directly)."""
        for engine_id, engine in list(self._engines.items()):
            if engine.down:
                continue
            error = check_health(engine.spec.base_url)
            if error is None:
                engine.num_failures = 0
                self._heartbeat(engine)
                continue
            engine.num_failures += 1
            if engine.num_failures >= self.config.max_failures:
                self.mark_down(engine_id, f"health check failed {engine.num_failures}x: {error}")

    def _heartbeat(self, engine: _Engine) -> None:
        spec = engine.spec
        info: dict[str, str | int] = {
            "kind": spec.kind,
            "base_url": spec.base_url,
            "block_size": self.block_size,
        }
        ttl_ms = int(self.config.heartbeat_ttl_s * 1000)
        if engine.feed.publisher.heartbeat(info, ttl_ms):
            engine.feed.keep_claim(self.owner, ttl_ms)

    def _watch(self) -> None:
        while not self._stop.wait(self.config.health_interval_s):
            try:
                self.check_once()
            except Exception:  # the watch must go on
                log.exception("engine health check failed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for engine in self._engines.values():
            engine.feed.close()
            engine.subscriber.stop()
            engine.feed.publisher.release_feed(self.owner)  # another coordinator takes over
            engine.feed.publisher.close()


def check_health(base_url: str, timeout_s: float = 3.0) -> str | None:
    """None when `GET {base_url}/health` answers 200, else why not."""
    url = urlsplit(base_url)
    cls = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
    conn = cls(url.netloc, timeout=timeout_s)
    try:
        conn.request("GET", url.path.rstrip("/") + "/health")
        response = conn.getresponse()
        response.read()
        return None if response.status == 200 else f"HTTP {response.status}"
    except (OSError, http.client.HTTPException) as exc:
        return str(exc) or type(exc).__name__
    finally:
        conn.close()
