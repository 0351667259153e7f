"""Follows one engine's KV-event stream over ZMQ: the one kvmesh module that imports zmq.

vLLM's and SGLang's publishers send multipart messages on a PUB socket and keep recent batches
for replay behind a ROUTER socket:

    PUB  ->  [topic, seq (8 bytes, big-endian, from 0), msgpack payload]
    ROUTER:  ask  [b"", start seq (8 bytes)]  ->  [b"", (topic,) seq, payload] ...
                                                  [b"", (b"",) -1, b""]     (topic: vLLM >= 0.2x)

The subscriber connects to both (the engine binds them: a wildcard endpoint such as
`tcp://*:5557` in the engine's `--kv-events-config`). Sequence numbers must arrive without gaps:

    next seq == expected       apply
    next seq  > expected       a gap: replay [expected, seq) through the ROUTER socket; if the
                               replay does not cover it, the engine's state is unknown: reset
    next seq  < expected       a batch already applied (the live stream and a replay overlap:
                               same seq, same payload) is dropped; anything else means the
                               engine restarted (its counter began again): reset

A reset tells the owner to clear everything it knew about this engine. On start the subscriber
asks for a replay from 0, so blocks the engine stored before kvmesh came up are learned while
the engine still buffers them. Payloads that do not decode are counted and skipped.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from kvmesh.coordinator.engines.engine_events import EngineDecodeError, EngineEventBatch

log = logging.getLogger(__name__)

_END_SEQ = -1
_NUM_RECENT = 4096
"""Applied batches remembered (seq -> payload digest) to tell a duplicate from a restart."""


@dataclass(frozen=True, slots=True)
class SubscriberConfig:
    endpoint: str
    """The engine's PUB endpoint, to connect to (e.g. tcp://127.0.0.1:5557)."""
    replay_endpoint: str = ""
    """The engine's ROUTER replay endpoint; empty: gaps reset the engine's state."""
    topic: str = ""
    """Subscribe to this topic prefix ("" takes every topic)."""
    poll_ms: int = 100
    """How long one poll waits (the stop flag is checked between polls)."""
    replay_timeout_ms: int = 2000
    """How long a replay may be silent before it is given up."""

    def __post_init__(self) -> None:
        if not self.endpoint:
            raise ValueError("an engine's KV-event endpoint is required")
        if self.poll_ms < 1 or self.replay_timeout_ms < 1:
            raise ValueError(
                f"poll_ms ({self.poll_ms}) and replay_timeout_ms ({self.replay_timeout_ms})"
                " must be >= 1"
            )


@dataclass(slots=True)
class SubscriberCounters:
    num_batches: int = 0
    num_replayed_batches: int = 0
    num_gaps: int = 0
    num_resets: int = 0
    num_undecodable: int = 0
    num_skipped_events: int = 0


class EngineEventSubscriber:
    """Reads one engine's stream on its own thread and hands every batch, in sequence order, to
    `on_batch`; `on_reset(reason)` when the engine's state must be forgotten.

    Invariant: batches reach `on_batch` with strictly increasing seq between two resets.
    """

    def __init__(
        self,
        config: SubscriberConfig,
        decode: Callable[[bytes], EngineEventBatch],
        on_batch: Callable[[EngineEventBatch], None],
        on_reset: Callable[[str], None],
        *,
        name: str = "engine",
    ) -> None:
        self.config = config
        self._decode = decode
        self._on_batch = on_batch
        self._on_reset = on_reset
        self.name = name
        self.counters = SubscriberCounters()
        self.expected_seq: int | None = None
        """The next seq to apply; None before the first."""
        self._recent: OrderedDict[int, bytes] = OrderedDict()
        self._ctx = zmq.Context()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.subscribed = threading.Event()
        """Set once the SUB socket is connected (events published before may still be lost:
        the start-up replay recovers them)."""

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name=f"kvmesh-events-{self.name}", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            if self._thread.is_alive():  # term() would wait for its sockets forever
                log.warning("engine %s: the KV-event subscriber did not stop", self.name)
                return
        self._ctx.term()

    # ---- the loop -----------------------------------------------------------------------------

    def _run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.config.topic.encode("utf-8"))
        sub.connect(self.config.endpoint)
        self.subscribed.set()
        try:
            if self.config.replay_endpoint:
                self._catch_up(0, None)
            while not self._stop.is_set():
                if not sub.poll(self.config.poll_ms):
                    continue
                frames = sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    self.counters.num_undecodable += 1
                    continue
                self.receive(int.from_bytes(frames[1], "big", signed=True), frames[2])
        except Exception:  # the loop must survive anything a payload or a callback does
            log.exception("engine %s: the KV-event subscriber stopped", self.name)
        finally:
            sub.close(linger=0)

    def receive(self, seq: int, payload: bytes) -> None:
        """One live message (called on the subscriber thread; public for tests)."""
        expected = self.expected_seq
        if expected is not None and seq < expected:
            if self._recent.get(seq) == _digest(payload):
                return  # applied already (from a replay that overlapped the live stream)
            self._reset(f"sequence went back from {expected} to {seq} (engine restarted)")
        elif expected is not None and seq > expected:
            self.counters.num_gaps += 1
            if not self._catch_up(expected, seq):
                self._reset(f"batches {expected}..{seq - 1} were lost and not replayed")
        elif expected is None and seq > 0 and self.config.replay_endpoint:
            self._catch_up(0, seq)  # whatever the engine still buffers from before we joined
        self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        if self.expected_seq is not None and seq < self.expected_seq:
            return  # already applied (a replay overlapped the live stream)
        self.expected_seq = seq + 1
        self._recent[seq] = _digest(payload)
        if len(self._recent) > _NUM_RECENT:
            self._recent.popitem(last=False)
        try:
            batch = self._decode(payload)
        except EngineDecodeError as exc:
            self.counters.num_undecodable += 1
            log.warning("engine %s: skipped batch %d: %s", self.name, seq, exc)
            return
        self.counters.num_batches += 1
        self.counters.num_skipped_events += batch.num_skipped
        if batch.num_skipped:
            log.warning(
                "engine %s: skipped %d event(s) of batch %d: %s",
                self.name,
                batch.num_skipped,
                seq,
                "; ".join(batch.skipped_reasons),
            )
        self._on_batch(batch)

    def _reset(self, reason: str) -> None:
        log.warning("engine %s: %s; forgetting its blocks", self.name, reason)
        self.counters.num_resets += 1
        self.expected_seq = None
        self._recent.clear()
        self._on_reset(reason)

    def _catch_up(self, start: int, until: int | None) -> bool:
        """Replay [start, until) (until None: everything buffered); True if all of it came."""
        if not self.config.replay_endpoint:
            return False
        replayed = self.replay(start)
        if replayed is None:
            return False
        covered = bool(replayed) and replayed[0][0] <= start
        for seq, payload in replayed:
            if until is not None and seq >= until:
                break
            if self.expected_seq is None or seq >= self.expected_seq:
                self.counters.num_replayed_batches += 1
                self._apply(seq, payload)
        if until is None:
            return covered
        return covered and self.expected_seq == until

    def replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """Ask the engine's ROUTER socket for its batches from `start`; None if it does not
        answer in time."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(self.config.replay_endpoint)
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            out: list[tuple[int, bytes]] = []
            while True:
                if not sock.poll(self.config.replay_timeout_ms):
                    log.warning("engine %s: replay from %d timed out", self.name, start)
                    return None
                frames = sock.recv_multipart()[1:]  # after the empty delimiter
                if len(frames) == 3:  # newer vLLM: [topic, seq, payload]
                    frames = frames[1:]
                if len(frames) != 2 or len(frames[0]) != 8:
                    return None
                seq = int.from_bytes(frames[0], "big", signed=True)
                if seq == _END_SEQ:
                    return out
                out.append((seq, frames[1]))
        finally:
            sock.close(linger=0)


def _digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()
