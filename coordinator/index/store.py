"""The coordinator's view of Redis: snapshots, the event stream, purges. The one coordinator
module that imports redis.

A follower first notes each shard stream's last id, then reads every worker's snapshot, then
reads the streams from the noted ids: batches already inside a snapshot come back as duplicates
(their seq is not newer) and are ignored by the mirror, so nothing falls in between. The index
lives on one Redis or is sharded over a Redis Cluster (`schema.cluster_url`); only this module
and the worker's publisher know the difference.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import redis

from kvmesh.coordinator.index.decision_log_store import COMMIT_DECISION, DecisionLogStore
from kvmesh.coordinator.index.service_directory import ServiceDirectory, WorkerService
from kvmesh.proto import redis_schema as schema
from kvmesh.proto import redis_scripts as scripts
from kvmesh.proto.block_hash import BlockHash
from kvmesh.proto.events import EventBatch, EventDecodeError, decode_batch
from kvmesh.proto.request_notes import NoteBatch, NoteDecodeError, decode_notes, encode_notes

__all__ = [
    "IndexStore",
    "Link",
    "SnapshotLinks",
    "StoreError",
    "StreamEntry",
    "WorkerService",
    "WorkerSnapshot",
]

log = logging.getLogger(__name__)

_CLUSTER_IDLE_MS = 5

# What every store call may raise when Redis is away; followers catch this, not redis itself.
StoreError = redis.RedisError


# One worker's info and blocks, atomically, with the blocks packed into two strings: the hashes
# (16 hex digits each) and their values (`schema.block_value`: 25 characters each; a value of the
# layout before links, one digit, is padded with "no link"). HKEYS and HVALS walk the hash in the
# same order. A rebuild then parses two strings per worker instead of a reply of 2 x num_blocks
# items (redis-py's pure-Python reply parser took ~3 s for 1M blocks).
_SNAPSHOT = """
local keys = redis.call('HKEYS', KEYS[2])
local vals = redis.call('HVALS', KEYS[2])
local joined = table.concat(vals)
if #joined ~= 25 * #vals then
  for i, v in ipairs(vals) do
    if #v == 1 then
      vals[i] = v .. string.rep('0', 24)
    end
  end
  joined = table.concat(vals)
  if #joined ~= 25 * #vals then
    return redis.error_reply('a value of ' .. KEYS[2] .. ' is neither a tier nor a block value')
  end
end
return {redis.call('HGETALL', KEYS[1]), table.concat(keys), joined}
"""

# KEYS[1] the epoch key; ARGV[1] an epoch. Raises the key to it if lower; returns the key's value.
_RAISE_EPOCH = """
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
local wanted = tonumber(ARGV[1])
if current < wanted then
  redis.call('SET', KEYS[1], wanted)
  return wanted
end
return current
"""


Link = tuple[BlockHash, BlockHash, int]
"""A block's radix link: (hash, parent, depth), depth 0 when unknown."""

_NO_HASHES = np.zeros(0, dtype=np.uint64)


@dataclass(frozen=True, slots=True)
class SnapshotLinks:
    """The radix links a worker recorded, for its blocks whose parent it knows, as columns (a
    rebuild of 1M blocks would spend ~0.2 s making their tuples; a follower makes them a chunk
    at a time, after it serves)."""

    hashes: np.ndarray = field(default_factory=lambda: _NO_HASHES)
    parents: np.ndarray = field(default_factory=lambda: _NO_HASHES)
    depths: np.ndarray = field(default_factory=lambda: _NO_HASHES)
    """0: unknown."""

    def __len__(self) -> int:
        return len(self.hashes)

    def tuples(self, start: int = 0, stop: int | None = None) -> list[Link]:
        """Links `start` to `stop` (None: the end) as (hash, parent, depth)."""
        columns = (self.hashes[start:stop], self.parents[start:stop], self.depths[start:stop])
        return cast(list[Link], list(zip(*(c.tolist() for c in columns), strict=True)))


@dataclass(frozen=True, slots=True)
class WorkerSnapshot:
    worker_id: str
    generation: int
    seq: int
    blocks: list[tuple[BlockHash, int]] = field(default_factory=list)
    info: dict[str, str] = field(default_factory=dict)
    links: SnapshotLinks = field(default_factory=SnapshotLinks)


@dataclass(frozen=True, slots=True)
class StreamEntry:
    stream: str
    """The shard stream it came from (`schema.EVENTS_STREAMS`)."""
    entry_id: str
    batch: EventBatch | None = None  # an event batch, or
    purged_worker: str | None = None  # a worker that was purged, or
    notes: NoteBatch | None = None  # request notes about a worker, or none (undecodable)


class IndexStore(DecisionLogStore, ServiceDirectory):
    """Reads and maintains the index in Redis for one coordinator; with the decision log and
    the directory of service workers every coordinator attaches to, on the same client."""

    def __init__(self, redis_url: str, *, socket_timeout_s: float = 2.0) -> None:
        # Any: redis-py's reply types are unions of bytes/str/None that it never narrows.
        url, self.is_cluster = schema.cluster_url(redis_url)
        kwargs = {"socket_timeout": socket_timeout_s, "socket_connect_timeout": socket_timeout_s}
        self._client: Any = (
            redis.RedisCluster.from_url(url, **kwargs)
            if self.is_cluster
            else redis.Redis.from_url(url, **kwargs)
        )
        self._purge = self._client.register_script(scripts.PURGE_WORKER)
        self._snapshot = self._client.register_script(_SNAPSHOT)
        self._raise_epoch = self._client.register_script(_RAISE_EPOCH)
        self._commit_decision = self._client.register_script(COMMIT_DECISION)
        self.num_decode_errors = 0

    def ping(self) -> bool:
        try:
            return bool(self._client.ping())
        except redis.RedisError:
            return False

    def last_stream_ids(self) -> dict[str, str]:
        """Each shard stream's last entry id ("0-0" for an empty one)."""
        pipe = self._client.pipeline(transaction=False)
        for stream in schema.EVENTS_STREAMS:
            pipe.xrevrange(stream, count=1)
        return {
            stream: last[0][0].decode() if last else "0-0"
            for stream, last in zip(schema.EVENTS_STREAMS, pipe.execute(), strict=True)
        }

    def worker_ids(self) -> list[str]:
        pipe = self._client.pipeline(transaction=False)
        for shard in range(schema.NUM_INDEX_SHARDS):
            pipe.smembers(schema.workers_key(shard))
        return sorted(w.decode() for members in pipe.execute() for w in members)

    def snapshot(self, worker_id: str) -> WorkerSnapshot | None:
        """A consistent copy of one worker's state (one script call), or None if unknown."""
        keys = [schema.worker_key(worker_id), schema.worker_blocks_key(worker_id)]
        raw_info, hex_blob, value_blob = self._snapshot(keys=keys)
        if isinstance(raw_info, dict):  # RESP3 replies maps as dicts, RESP2 as flat lists
            raw_info = [x for kv in raw_info.items() for x in kv]
        info = {k.decode(): v.decode() for k, v in zip(raw_info[::2], raw_info[1::2], strict=True)}
        if "generation" not in info:
            return None
        hashes = np.frombuffer(bytes.fromhex(hex_blob.decode()), dtype=">u8")
        rows = np.frombuffer(value_blob, dtype=np.uint8).reshape(-1, schema.BLOCK_VALUE_LEN)
        tiers = (rows[:, 0] - ord("0")).tolist()
        parents = np.frombuffer(bytes.fromhex(rows[:, 1:17].tobytes().decode()), dtype=">u8")
        depths = np.frombuffer(bytes.fromhex(rows[:, 17:].tobytes().decode()), dtype=">u4")
        linked = parents != 0
        # BlockHash is a NewType of int: skip its per-block identity call on this hot path.
        blocks = cast(list[tuple[BlockHash, int]], list(zip(hashes.tolist(), tiers, strict=True)))
        links = SnapshotLinks(hashes[linked], parents[linked], depths[linked])
        return WorkerSnapshot(
            worker_id, int(info["generation"]), int(info["seq"]), blocks, info, links
        )

    def worker_info(self, worker_id: str) -> dict[str, str]:
        raw = self._client.hgetall(schema.worker_key(worker_id))
        return {k.decode(): v.decode() for k, v in raw.items()}

    def is_alive(self, worker_id: str) -> bool:
        return bool(self._client.exists(schema.worker_alive_key(worker_id)))

    def block_holders(self, ns: str, block_hash: BlockHash) -> dict[str, int]:
        """Every worker of namespace `ns` holding the block, and its tier (one read per worker:
        for tests and operators; the mirror answers this on the serving path)."""
        values = self._block_values(ns, block_hash)
        return {w: int(v[:1]) for w, (v, _bs) in values.items()}

    def node(self, ns: str, block_hash: BlockHash) -> dict[str, str]:
        """One block's radix metadata as the first worker holding it with a known parent
        records it: `p` parent (16 hex digits), `d` depth, `t` tokens through it ({}: none)."""
        for value, block_size in self._block_values(ns, block_hash).values():
            if len(value) == schema.BLOCK_VALUE_LEN and value[1:17] != schema.NO_PARENT_HEX:
                depth = int(value[17:], 16)
                return {"p": value[1:17], "d": str(depth), "t": str(depth * block_size)}
        return {}

    def _block_values(self, ns: str, block_hash: BlockHash) -> dict[str, tuple[str, int]]:
        """Per worker of `ns` holding the block: its value there, and the worker's block size."""
        workers = self.worker_ids()
        pipe = self._client.pipeline(transaction=False)
        for w in workers:
            pipe.hget(schema.worker_blocks_key(w), schema.hash_hex(block_hash))
            pipe.hmget(schema.worker_key(w), ["ns", "block_size"])
        replies = pipe.execute()
        out = {}
        for w, value, (w_ns, block_size) in zip(workers, replies[::2], replies[1::2], strict=True):
            if value is not None and (w_ns is None or w_ns.decode() == ns):
                out[w] = (value.decode(), int(block_size or 0))
        return out

    def cache_epoch(self, ns: str) -> int:
        """The fleet's cache epoch: the epoch key, or the highest epoch a worker reports if
        that is higher (Redis restarted empty while the workers lived on)."""
        pipe = self._client.pipeline(transaction=False)
        pipe.get(schema.epoch_key(ns))
        for w in self.worker_ids():
            pipe.hget(schema.worker_key(w), "cache_epoch")
        raw, *reported = pipe.execute()
        return max([int(raw or 0), *(int(r) for r in reported if r is not None)])

    def raise_cache_epoch(self, ns: str, epoch: int) -> int:
        """Set the namespace's cache epoch to `epoch` unless it is higher already; returns it
        (so a worker starting now hashes under what the fleet uses)."""
        return int(self._raise_epoch(keys=[schema.epoch_key(ns)], args=[epoch]))

    def bump_cache_epoch(self, ns: str, at_least: int) -> int:
        """Move the namespace's cache epoch on (to `at_least` if that is higher); returns it."""
        epoch = int(self._client.incr(schema.epoch_key(ns)))
        return self.raise_cache_epoch(ns, at_least) if epoch < at_least else epoch

    def purge_worker(self, ns: str, worker_id: str) -> int:
        prefix = schema.shard_prefix(schema.index_shard(worker_id))
        args: list[str | int] = [ns, worker_id, schema.EVENTS_STREAM_MAXLEN, prefix]
        return int(self._purge(keys=schema.purge_worker_keys(worker_id), args=args))

    def read_stream(
        self, after_ids: Mapping[str, str], block_ms: int | None, count: int = 512
    ) -> list[StreamEntry]:
        """Entries of every shard stream after its id in `after_ids` (a stream left out: from
        its start), waiting up to block_ms for the first one (None: no wait). On a cluster the
        streams are read without blocking (a blocking read names one slot); an empty round
        then waits a few milliseconds instead."""
        streams = {s: after_ids.get(s, "0-0") for s in schema.EVENTS_STREAMS}
        if not self.is_cluster:
            reply = self._client.xread(streams, count=count, block=block_ms)
            return list(self._entries(reply))
        entries = list(self._entries(self._read_cluster_streams(streams, count)))
        if not entries and block_ms:
            time.sleep(min(block_ms, _CLUSTER_IDLE_MS) / 1e3)
        return entries

    def _read_cluster_streams(self, streams: dict[str, str], count: int) -> list[Any]:
        """One pipeline per master, one XREAD per stream (a multi-key XREAD must stay in one
        slot)."""
        by_node: dict[str, tuple[Any, list[str]]] = {}
        for stream in streams:
            node = self._client.get_node_from_key(stream)
            by_node.setdefault(node.name, (node, []))[1].append(stream)
        reply: list[Any] = []
        for node, names in by_node.values():
            pipe = self._client.get_redis_connection(node).pipeline(transaction=False)
            for stream in names:
                pipe.xread({stream: streams[stream]}, count=count)
            for part in pipe.execute():
                reply.extend(part or [])
        return reply

    def _entries(self, reply: Any) -> Iterator[StreamEntry]:
        for raw_stream, entries in reply or []:
            stream = raw_stream.decode() if isinstance(raw_stream, bytes) else raw_stream
            for entry_id, fields in entries:
                eid = entry_id.decode()
                if b"p" in fields:
                    yield StreamEntry(stream, eid, purged_worker=fields[b"p"].decode())
                    continue
                if b"r" in fields:
                    yield StreamEntry(stream, eid, notes=self._notes(eid, fields[b"r"]))
                    continue
                try:
                    yield StreamEntry(stream, eid, batch=decode_batch(fields.get(b"b", b"")))
                except EventDecodeError as exc:
                    self.num_decode_errors += 1
                    log.warning("rejected event batch %s: %s", eid, exc)
                    yield StreamEntry(stream, eid)

    def append_notes(self, batches: Sequence[NoteBatch]) -> None:
        """Append request notes to their workers' shard streams, in one round trip (a cluster:
        one per master). Every follower of the stream gets them."""
        pipe = self._client.pipeline(transaction=False)
        for batch in batches:
            pipe.xadd(
                schema.worker_events_key(batch.worker_id),
                {"r": encode_notes(batch)},
                maxlen=schema.EVENTS_STREAM_MAXLEN,
                approximate=True,
            )
        pipe.execute()

    def _notes(self, entry_id: str, data: bytes) -> NoteBatch | None:
        try:
            return decode_notes(data)
        except NoteDecodeError as exc:
            self.num_decode_errors += 1
            log.warning("rejected request notes %s: %s", entry_id, exc)
            return None

    def close(self) -> None:
        self._client.close()
