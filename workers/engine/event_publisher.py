"""Publishes a worker's KV events to Redis: the one module on the worker side that imports redis.

Each batch is applied to the index keys and appended to the event stream by one script call, so
the index and the stream never disagree. If Redis is unreachable the worker keeps serving; the
publisher remembers that it lost events and, once Redis answers again, the worker re-publishes its
whole pool under a new generation (followers then reload it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis

from kvmesh.proto import redis_schema as schema
from kvmesh.proto import redis_scripts as scripts
from kvmesh.proto.events import AllCleared, BlockStored, EventBatch, encode_batch
from kvmesh.proto.request_notes import NoteBatch, encode_notes

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PublishResult:
    ok: bool
    num_applied: int  # block events applied; 0 when stale or failed


def batch_to_argv(ns: str, batch: EventBatch, maxlen: int) -> list[str | bytes | int]:
    """ARGV of `scripts.APPLY_BATCH` (its KEYS: `schema.apply_batch_keys(batch.worker_id)`)."""
    # A block stored without its link keeps the one it had, also when this batch dropped it
    # first (removed, cleared, or wiped by a new generation, whose first batch has seq 1).
    drops = batch.seq == 1 or any(not isinstance(e, BlockStored) for e in batch.events)
    may_keep = drops and any(
        isinstance(e, BlockStored) and not _values_known(e) for e in batch.events
    )
    argv: list[str | bytes | int] = [
        ns,
        batch.worker_id,
        str(batch.generation),
        batch.seq,
        encode_batch(batch),
        maxlen,
        schema.shard_prefix(schema.index_shard(batch.worker_id)),
        "1" if may_keep else "",
    ]
    for e in batch.events:
        if isinstance(e, AllCleared):
            argv.append("C")
            continue
        # Big-endian bytes in hex: `schema.hash_hex` of each hash, concatenated, in one call.
        hex_blob = np.array(e.hashes, dtype=">u8").tobytes().hex().encode()
        if isinstance(e, BlockStored):
            values = _stored_values(e, hex_blob) if _values_known(e) else b""
            argv += ["S", str(e.tier), hex_blob, values, schema.hash_hex(e.parent_hash), e.depth]
        else:
            argv += ["R", str(e.tier), hex_blob]
    return argv


def _values_known(e: BlockStored) -> bool:
    """Whether the writer can work out every block's value (parent and depth known)."""
    n = len(e.hashes)
    return n > 0 and bool(e.parent_hash) and 0 < e.depth <= schema.MAX_LINK_DEPTH - n + 1


def _stored_values(e: BlockStored, hex_blob: bytes) -> bytes:
    """`schema.block_value` of each block of a chain whose parent and depth are known: block k
    follows block k - 1 (the first, `e.parent_hash`) at depth `e.depth + k`; built in numpy,
    one row of `BLOCK_VALUE_LEN` characters per block."""
    n = len(e.hashes)
    rows = np.empty((n, schema.BLOCK_VALUE_LEN), dtype=np.uint8)
    rows[:, 0] = ord("0") + e.tier
    hexes = np.frombuffer(hex_blob, dtype=np.uint8).reshape(n, 16)
    rows[0, 1:17] = np.frombuffer(schema.hash_hex(e.parent_hash).encode(), dtype=np.uint8)
    rows[1:, 1:17] = hexes[:-1]
    depths = np.arange(e.depth, e.depth + n, dtype=">u4").tobytes().hex().encode()
    rows[:, 17:] = np.frombuffer(depths, dtype=np.uint8).reshape(n, 8)
    return rows.tobytes()


def connect(redis_url: str, socket_timeout_s: float) -> Any:
    """A client for `redis_url`: a Redis Cluster client when the URL says `cluster=1`
    (`schema.cluster_url`), else a plain one."""
    url, is_cluster = schema.cluster_url(redis_url)
    kwargs = {"socket_timeout": socket_timeout_s, "socket_connect_timeout": socket_timeout_s}
    if is_cluster:
        return redis.RedisCluster.from_url(url, **kwargs)
    return redis.Redis.from_url(url, **kwargs)


class EventPublisher:
    """Writes event batches, worker info and heartbeats for one worker."""

    def __init__(self, redis_url: str, ns: str, worker_id: str, *, socket_timeout_s: float = 2.0):
        self.ns = ns
        self.worker_id = worker_id
        self._client: Any = connect(redis_url, socket_timeout_s)
        self._apply = self._client.register_script(scripts.APPLY_BATCH)
        self._keys = schema.apply_batch_keys(worker_id)
        self._notes_stream = schema.worker_events_key(worker_id)
        self.lost_events = False  # a batch failed: the next success must be a full re-publish
        self.connected = True
        self.published_once = False

    def publish(self, batch: EventBatch, notes: NoteBatch | None = None) -> PublishResult:
        """Apply `batch`; `notes` (the step's request notes), if any, are appended after it, in
        the same round trip on a single Redis (a cluster's pipeline runs no scripts: two)."""
        pipelined = notes is not None and not isinstance(self._client, redis.RedisCluster)
        try:
            argv = batch_to_argv(self.ns, batch, schema.EVENTS_STREAM_MAXLEN)
            if not pipelined:
                n = int(self._apply(keys=self._keys, args=argv))
            else:
                assert notes is not None
                pipe = self._client.pipeline(transaction=False)
                self._apply(keys=self._keys, args=argv, client=pipe)
                self._append_notes(pipe, notes)
                n = int(pipe.execute()[0])
        except redis.RedisError as exc:
            if self.connected:
                log.warning("worker %s: cannot publish KV events (%s)", self.worker_id, exc)
            self.connected = False
            self.lost_events = True
            return PublishResult(False, 0)
        self.connected = True
        self.published_once = True
        if notes is not None and not pipelined:
            self.publish_notes(notes)
        return PublishResult(True, max(n, 0))

    def publish_notes(self, batch: NoteBatch) -> bool:
        """Append request notes to the worker's shard stream (no index keys change). Best
        effort: a note lost while Redis is away only leaves other replicas less informed."""
        try:
            self._append_notes(self._client, batch)
        except redis.RedisError:
            return False
        return True

    def _append_notes(self, client: Any, batch: NoteBatch) -> None:
        client.xadd(
            self._notes_stream,
            {"r": encode_notes(batch)},
            maxlen=schema.EVENTS_STREAM_MAXLEN,
            approximate=True,
        )

    def heartbeat(self, info: dict[str, str | int], ttl_ms: int) -> bool:
        try:
            pipe = self._client.pipeline(transaction=False)
            pipe.hset(schema.worker_key(self.worker_id), mapping=info)
            pipe.set(schema.worker_alive_key(self.worker_id), "1", px=ttl_ms)
            pipe.sadd(schema.workers_key(schema.index_shard(self.worker_id)), self.worker_id)
            pipe.hexists(schema.worker_key(self.worker_id), "generation")
            has_state = pipe.execute()[-1]
        except redis.RedisError:
            self.connected = False
            self.lost_events = True
            return False
        if self.published_once and not has_state:
            self.lost_events = True  # purged, or Redis restarted empty: re-publish in full
        self.connected = True
        return True

    def keep_alive(self, ttl_ms: int) -> bool:
        """Refresh only the liveness key (safe from another thread than `heartbeat`'s); False
        when Redis is away."""
        try:
            self._client.set(schema.worker_alive_key(self.worker_id), "1", px=ttl_ms)
        except redis.RedisError:
            return False
        return True

    def claim_feed(self, owner: str, ttl_ms: int) -> bool:
        """Take or renew the right to publish for this (external engine's) id; False when
        another owner holds it or Redis is away."""
        try:
            key = schema.feeder_key(self.worker_id)
            return bool(self._client.eval(scripts.CLAIM_FEED, 1, key, owner, ttl_ms))
        except redis.RedisError:
            return False

    def release_feed(self, owner: str) -> None:
        try:
            self._client.eval(scripts.RELEASE_FEED, 1, schema.feeder_key(self.worker_id), owner)
        except redis.RedisError:
            pass  # the claim lapses with its TTL

    def cache_epoch(self) -> int | None:
        """The namespace's cache epoch in Redis (0 if never bumped), or None if unreachable."""
        try:
            raw = self._client.get(schema.epoch_key(self.ns))
        except redis.RedisError:
            return None
        return int(raw) if raw is not None else 0

    def close(self) -> None:
        self._client.close()
