"""Keeps an `IndexMirror` in step with Redis: initial rebuild, the event stream, resyncs, purges.

Runs on its own thread. While Redis is unreachable the mirror keeps its last state (the router
then routes by load only, see `connected`); when Redis answers again the mirror is rebuilt from
the snapshots, which the workers re-publish in full once they reconnect.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvmesh.coordinator.index.locked_mirror import LockedMirror
from kvmesh.coordinator.index.mirror import ApplyResult, WorkerId
from kvmesh.coordinator.index.store import IndexStore, SnapshotLinks, StoreError
from kvmesh.proto.request_notes import NoteBatch

log = logging.getLogger(__name__)

_READ_BLOCK_MS = 100
_RETRY_S = 0.2
_SWEEP_S = 1.0
_LINKS_PER_POLL = 20_000


class IndexFollower:
    """Owns the mirror's writes. A worker whose heartbeat lapsed is reported to `on_lapsed`
    (the worker registry, which fans it out; by default it is purged here directly). Request
    notes (coordinators' and workers'), which ride the same streams, go to `on_notes` (the
    coordinator's load tracker; by default nowhere)."""

    def __init__(
        self,
        store: IndexStore,
        mirror: LockedMirror,
        *,
        ns: str,
        on_lapsed: Callable[[str], None] | None = None,
        on_notes: Callable[[NoteBatch], None] | None = None,
    ) -> None:
        self.store = store
        self.mirror = mirror
        self.ns = ns
        self._on_lapsed = on_lapsed or self.purge_worker
        self.on_notes = on_notes
        self.on_notes_skipped: Callable[[], None] | None = None
        """Called after a rebuild, which skips the streams to their end: request notes written
        meanwhile (a request's end among them) are never read."""
        self.connected = False
        self.num_resyncs = 0
        self.last_event_lag_s: float | None = None
        """How old the newest applied stream entry was when applied, by its Redis-assigned id
        (milliseconds on Redis' clock, so a skew between the two hosts shows up here); None
        before the first entry."""
        self._last_ids: dict[str, str] = {}
        """Per shard stream, the last entry handled (a stream missing: none yet)."""
        self._links_pending: dict[WorkerId, tuple[SnapshotLinks, int]] = {}
        """Per worker, the radix links its last snapshot brought, and how many of them the tree
        has been given."""
        self.cache_epoch = 0
        """The namespace's cache epoch, as last read from Redis (or bumped here); never goes
        back. Part of every root hash (`cache_root`)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvmesh-index", daemon=True)
        self._last_sweep = 0.0

    def start(self, wait_s: float = 5.0) -> None:
        try:
            self.rebuild()
        except StoreError as exc:
            log.warning(
                "index: Redis unreachable at start (%s); serving with load-only routing", exc
            )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def rebuild(self) -> int:
        """Reload every worker from Redis; returns the number of blocks loaded."""
        last_ids = self.store.last_stream_ids()
        loaded = 0
        for worker in self.store.worker_ids():
            loaded += self.resync(worker)
        self._last_ids = last_ids
        self._read_epoch()
        self.connected = True
        if self.on_notes_skipped is not None:
            self.on_notes_skipped()
        return loaded

    def resync(self, worker: str) -> int:
        snap = self.store.snapshot(worker)
        if snap is None:
            self.mirror.remove_worker(WorkerId(worker))
            return 0
        self.mirror.load_worker(WorkerId(worker), snap.generation, snap.seq, snap.blocks)
        if len(snap.links):
            self._links_pending[WorkerId(worker)] = (snap.links, 0)
        else:
            self._links_pending.pop(WorkerId(worker), None)
        self.num_resyncs += 1
        return len(snap.blocks)

    def load_links(self, max_blocks: int | None = None) -> int:
        """Give the tree the radix links resyncs brought (a cold mirror, or blocks only a
        snapshot brought), at most `max_blocks` of them (None: all); returns how many were
        given. The follower thread calls it between polls: the tree is not on the routing path,
        so a cold coordinator serves before its tree is whole. A link the tree has is given
        again unchanged (a block's link follows from the hash chain); a block whose worker
        recorded no parent is linked by another worker's snapshot, if any."""
        num_given = 0
        while self._links_pending and (max_blocks is None or num_given < max_blocks):
            worker, (links, start) = next(iter(self._links_pending.items()))
            stop = len(links) if max_blocks is None else start + max_blocks - num_given
            stop = min(stop, len(links))
            if stop < len(links):
                self._links_pending[worker] = (links, stop)
            else:
                del self._links_pending[worker]
            self.mirror.link(links.tuples(start, stop))
            num_given += stop - start
        return num_given

    def _read_epoch(self) -> None:
        known = self.store.cache_epoch(self.ns)
        if self.cache_epoch > known:  # Redis lost it: put it back for workers starting later
            self.store.raise_cache_epoch(self.ns, self.cache_epoch)
        self.cache_epoch = max(self.cache_epoch, known)

    def bump_cache_epoch(self) -> int:
        """A cache reset: the next epoch, agreed through Redis (this coordinator's own count
        when Redis is away)."""
        try:
            self.cache_epoch = self.store.bump_cache_epoch(self.ns, self.cache_epoch + 1)
        except StoreError as exc:
            log.warning("index: cache epoch bumped without Redis (%s)", exc)
            self.cache_epoch += 1
        return self.cache_epoch

    def poll_once(self, block_ms: int | None = _READ_BLOCK_MS) -> int:
        """Apply what the shard streams have after the last entries seen; returns entries
        handled. `block_ms` None returns at once (Redis times blocking reads out in 100 ms
        ticks). Streams interleave in any order; each worker's batches are in one of them."""
        entries = self.store.read_stream(self._last_ids, block_ms)
        for entry in entries:
            if entry.purged_worker is not None:
                self.mirror.remove_worker(WorkerId(entry.purged_worker))
            elif entry.batch is not None:
                result = self.mirror.apply(entry.batch)
                if result is ApplyResult.NEEDS_RESYNC:
                    self.resync(entry.batch.worker_id)
                elif result is ApplyResult.STARTED:  # an older snapshot's links are not its
                    self._links_pending.pop(WorkerId(entry.batch.worker_id), None)
            elif entry.notes is not None and self.on_notes is not None:
                self.on_notes(entry.notes)
            self._last_ids[entry.stream] = entry.entry_id
        if entries:
            self.last_event_lag_s = _age_s(entries[-1].entry_id, time.time())
        return len(entries)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if not self.connected:
                    self.rebuild()
                    log.info("index: Redis is back; mirror rebuilt")
                self.poll_once()
                self.load_links(_LINKS_PER_POLL)
                self._sweep_expired()
            except StoreError as exc:
                if self.connected:
                    log.warning("index: lost Redis (%s); routing by load only", exc)
                self.connected = False
                self._stop.wait(_RETRY_S)
            except Exception:  # a bug must not freeze the mirror: rebuild it from Redis
                log.exception("index: following the event stream failed; rebuilding the mirror")
                self.connected = False
                self._stop.wait(_RETRY_S)

    def _sweep_expired(self) -> None:
        """Purge workers whose heartbeat lapsed (their process died without anyone noticing).

        A live worker whose heartbeat merely stalled notices its missing state on its next
        heartbeat and re-publishes everything under a new generation.
        """
        now = time.monotonic()
        if now - self._last_sweep < _SWEEP_S:
            return
        self._last_sweep = now
        self._read_epoch()  # another coordinator's ClearCache reaches this one here
        for worker in self.store.worker_ids():
            if not self.store.is_alive(worker):
                log.warning("index: heartbeat of %s lapsed; purging its blocks", worker)
                self._on_lapsed(worker)

    def purge_worker(self, worker: str) -> None:
        """Forget a worker's blocks here and in Redis (Redis away: the sweep purges it later)."""
        self.mirror.remove_worker(WorkerId(worker))
        try:
            self.store.purge_worker(self.ns, worker)
        except StoreError as exc:
            log.warning("index: could not purge %s from Redis: %s", worker, exc)


def _age_s(entry_id: str, now_s: float) -> float | None:
    """Seconds since Redis appended the stream entry `entry_id` ("<ms>-<seq>"), never negative."""
    millis, _, _seq = entry_id.partition("-")
    if not millis.isdigit():
        return None
    return max(0.0, now_s - int(millis) / 1e3)
