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
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import redis

from kvmesh.coordinator.routing.decision_log import CommitResult
from kvmesh.proto import redis_schema as schema
from kvmesh.proto.block_hash import BlockHash
from kvmesh.proto.events import EventBatch, EventDecodeError, decode_batch
from kvmesh.proto.placements import (
    Placement,
    PlacementDecodeError,
    decode_placement,
    encode_placement,
)
from kvmesh.proto.request_notes import NoteBatch, NoteDecodeError, decode_notes, encode_notes

log = logging.getLogger(__name__)

_CLUSTER_IDLE_MS = 5

# What every store call may raise when Redis is away; followers catch this, not redis itself.
StoreError = redis.RedisError


# One worker's info and blocks, atomically, with the blocks packed into two strings: 16 hex digits
# per hash, one digit per tier (HKEYS and HVALS walk the hash in the same order). A rebuild then
# parses two strings per worker instead of a reply of 2 x num_blocks items (redis-py's pure-Python
# reply parser took ~3 s for 1M blocks).
_SNAPSHOT = """
local keys = redis.call('HKEYS', KEYS[2])
local tiers = table.concat(redis.call('HVALS', KEYS[2]))
if #tiers ~= #keys then
  return redis.error_reply('a tier of ' .. KEYS[2] .. ' is not one digit')
end
return {redis.call('HGETALL', KEYS[1]), table.concat(keys), tiers}
"""


# Radix links of many blocks at once, from one shard: KEYS[1] a key of the shard (it routes the
# call to the shard's node on a cluster), ARGV the shard's node-key prefix
# (`kvmesh:{sNN}:{ns}:node:`), then the blocks' 16-hex-digit names concatenated; returns the
# parents concatenated (16 zeros: no node in this shard) and the depths joined by commas.
_NODE_LINKS = """
local prefix = ARGV[1]
local blob = ARGV[2]
local parents, depths = {}, {}
for k = 0, #blob / 16 - 1 do
  local h = string.sub(blob, k * 16 + 1, k * 16 + 16)
  local node = redis.call('HMGET', prefix .. h, 'p', 'd')
  parents[#parents + 1] = node[1] or string.rep('0', 16)  -- NO_PARENT_HEX
  depths[#depths + 1] = node[2] or '0'
end
return {table.concat(parents), table.concat(depths, ',')}
"""
_LINKS_PER_CALL = 20_000

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


# The decision log's compare-and-set (`routing/decision_log.py`): KEYS[1] the sequence, KEYS[2]
# the stream; ARGV[1] the expected sequence (-1: append whatever it is), ARGV[2] the entry,
# ARGV[3] the stream's length cap, ARGV[4] the most entries a lost commit returns.
# Returns {1, seq} when appended as entry `seq`; else {0, seq, entries after the expected one}.
_COMMIT_DECISION = """
local seq = tonumber(redis.call('GET', KEYS[1]) or '0')
local expected = tonumber(ARGV[1])
if expected < 0 or expected == seq then
  seq = seq + 1
  redis.call('SET', KEYS[1], seq)
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], seq .. '-0', 'd', ARGV[2])
  return {1, seq}
end
if expected > seq then
  return {0, seq, {}}
end
return {0, seq, redis.call('XRANGE', KEYS[2], (expected + 1) .. '-0', '+', 'COUNT', ARGV[4])}
"""
_MAX_MISSED = 10_000


@dataclass(frozen=True, slots=True)
class NodeLink:
    """One block's radix metadata in Redis."""

    block_hash: BlockHash
    parent_hash: BlockHash
    """0: Redis has no node for the block."""
    depth: int


@dataclass(frozen=True, slots=True)
class WorkerSnapshot:
    worker_id: str
    generation: int
    seq: int
    blocks: list[tuple[BlockHash, int]] = field(default_factory=list)
    info: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class StreamEntry:
    stream: str
    """The shard stream it came from (`schema.EVENTS_STREAMS`)."""
    entry_id: str
    batch: EventBatch | None = None  # an event batch, or
    purged_worker: str | None = None  # a worker that was purged, or
    notes: NoteBatch | None = None  # request notes about a worker, or none (undecodable)


@dataclass(frozen=True, slots=True)
class WorkerService:
    """A worker running as a long-lived service: how any coordinator reaches it."""

    worker_id: str
    actor_name: str
    """Its detached Ray actor's name (in `ray_namespace`)."""
    ray_namespace: str
    num_gpus: float
    """GPUs its actor reserves (a replacement asks for the same)."""
    config_json: str
    """Its WorkerConfig, as JSON (a replacement starts from it)."""


class IndexStore:
    """Reads and maintains the index in Redis for one coordinator, and the directory of
    service workers every coordinator attaches to."""

    def __init__(self, redis_url: str, *, socket_timeout_s: float = 2.0) -> None:
        # Any: redis-py's reply types are unions of bytes/str/None that it never narrows.
        url, self.is_cluster = schema.cluster_url(redis_url)
        kwargs = {"socket_timeout": socket_timeout_s, "socket_connect_timeout": socket_timeout_s}
        self._client: Any = (
            redis.RedisCluster.from_url(url, **kwargs)
            if self.is_cluster
            else redis.Redis.from_url(url, **kwargs)
        )
        self._purge = self._client.register_script(schema.PURGE_WORKER)
        self._snapshot = self._client.register_script(_SNAPSHOT)
        self._node_links = self._client.register_script(_NODE_LINKS)
        self._raise_epoch = self._client.register_script(_RAISE_EPOCH)
        self._commit_decision = self._client.register_script(_COMMIT_DECISION)
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
        raw_info, hex_blob, tier_blob = self._snapshot(keys=keys)
        if isinstance(raw_info, dict):  # RESP3 replies maps as dicts, RESP2 as flat lists
            raw_info = [x for kv in raw_info.items() for x in kv]
        info = {k.decode(): v.decode() for k, v in zip(raw_info[::2], raw_info[1::2], strict=True)}
        if "generation" not in info:
            return None
        hashes = np.frombuffer(bytes.fromhex(hex_blob.decode()), dtype=">u8").tolist()
        tiers = (np.frombuffer(tier_blob, dtype=np.uint8) - ord("0")).tolist()
        # BlockHash is a NewType of int: skip its per-block identity call on this hot path.
        blocks = cast(list[tuple[BlockHash, int]], list(zip(hashes, tiers, strict=True)))
        return WorkerSnapshot(worker_id, int(info["generation"]), int(info["seq"]), blocks, info)

    def worker_info(self, worker_id: str) -> dict[str, str]:
        raw = self._client.hgetall(schema.worker_key(worker_id))
        return {k.decode(): v.decode() for k, v in raw.items()}

    def is_alive(self, worker_id: str) -> bool:
        return bool(self._client.exists(schema.worker_alive_key(worker_id)))

    def block_holders(self, ns: str, block_hash: BlockHash) -> dict[str, int]:
        """Every worker holding the block, from every shard."""
        hex_hash = schema.hash_hex(block_hash)
        pipe = self._client.pipeline(transaction=False)
        for shard in range(schema.NUM_INDEX_SHARDS):
            pipe.hgetall(schema.shard_block_key(shard, ns, hex_hash))
        return {k.decode(): int(v) for raw in pipe.execute() for k, v in raw.items()}

    def node_links(
        self, ns: str, hashes: list[BlockHash], *, first_shard: int | None = None
    ) -> list[NodeLink]:
        """The radix metadata Redis keeps for `hashes` (a cold mirror's tree comes from here).
        Each shard keeps the nodes of the blocks its workers hold, and those agree: a hash is
        looked up in `first_shard` (if given) and then, while it has no node yet, in the next
        shards; a hash with no node anywhere comes back with parent 0."""
        shards = list(range(schema.NUM_INDEX_SHARDS))
        if first_shard is not None:
            shards.remove(first_shard)
            shards.insert(0, first_shard)
        out: list[NodeLink] = []
        for start in range(0, len(hashes), _LINKS_PER_CALL):
            chunk = hashes[start : start + _LINKS_PER_CALL]
            parents = np.zeros(len(chunk), dtype=np.uint64)
            depths = np.zeros(len(chunk), dtype=np.int64)
            missing = np.arange(len(chunk))
            wanted = np.asarray(chunk, dtype=">u8")
            for shard in shards:
                found_parents, found_depths = self._shard_node_links(shard, ns, wanted[missing])
                found = found_parents != 0
                parents[missing[found]] = found_parents[found]
                depths[missing[found]] = found_depths[found]
                missing = missing[~found]
                if not len(missing):
                    break
            for h, parent, depth in zip(chunk, parents.tolist(), depths.tolist(), strict=True):
                out.append(NodeLink(h, BlockHash(parent), depth))
        return out

    def _shard_node_links(
        self, shard: int, ns: str, hashes: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Parents (0: no node) and depths of big-endian `hashes` in one shard (one call)."""
        prefix = schema.shard_node_key(shard, ns, "")
        keys = [schema.workers_key(shard)]
        parents_hex, depths = self._node_links(keys=keys, args=[prefix, hashes.tobytes().hex()])
        parents = np.frombuffer(bytes.fromhex(parents_hex.decode()), dtype=">u8").astype(np.uint64)
        return parents, np.array(depths.split(b","), dtype=np.int64)

    def node(self, ns: str, block_hash: BlockHash) -> dict[str, str]:
        """One block's radix metadata: the first shard's node that has it ({}: none)."""
        hex_hash = schema.hash_hex(block_hash)
        pipe = self._client.pipeline(transaction=False)
        for shard in range(schema.NUM_INDEX_SHARDS):
            pipe.hgetall(schema.shard_node_key(shard, ns, hex_hash))
        for raw in pipe.execute():
            if raw:
                return {k.decode(): v.decode() for k, v in raw.items()}
        return {}

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

    def num_block_keys(self, ns: str) -> int:
        """Block keys of `ns` over every shard (a SCAN: for tests and operators, not serving)."""
        pattern = f"{schema.PREFIX}:{{s*}}:{ns}:blk:*"
        return sum(1 for _ in self._client.scan_iter(match=pattern, count=1000))

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

    # ---- the decision log -------------------------------------------------------------------

    def commit_decision(self, expected_seq: int | None, placement: Placement) -> CommitResult:
        """Append `placement` to the decision log if it ends at `expected_seq` (None: anyway);
        a lost commit returns the entries after `expected_seq` (one round trip either way)."""
        keys = [schema.DECISIONS_SEQ_KEY, schema.DECISIONS_STREAM]
        expected = -1 if expected_seq is None else expected_seq
        entry = encode_placement(placement)
        args: list[bytes | int] = [expected, entry, schema.DECISIONS_STREAM_MAXLEN, _MAX_MISSED]
        reply = self._commit_decision(keys=keys, args=args)
        if int(reply[0]) == 1:
            return CommitResult(True, int(reply[1]))
        return CommitResult(False, int(reply[1]), tuple(self._decisions(reply[2])))

    def decision_seq(self) -> int:
        """Where the decision log ends now."""
        return int(self._client.get(schema.DECISIONS_SEQ_KEY) or 0)

    def read_decisions(self, after_seq: int, block_ms: int | None) -> list[tuple[int, Placement]]:
        """The log's entries after `after_seq`, waiting up to block_ms for the first."""
        reply = self._client.xread(
            {schema.DECISIONS_STREAM: f"{after_seq}-0"}, count=512, block=block_ms
        )
        return [e for _, entries in reply or [] for e in self._decisions(entries)]

    def _decisions(self, entries: Any) -> Iterator[tuple[int, Placement]]:
        for entry_id, fields in entries:
            raw = fields[b"d"] if isinstance(fields, dict) else dict(_pairs(fields))[b"d"]
            seq = int(entry_id.decode().partition("-")[0])
            try:
                yield seq, decode_placement(raw)
            except PlacementDecodeError as exc:
                self.num_decode_errors += 1
                log.warning("rejected decision %s: %s", seq, exc)

    # ---- the service directory --------------------------------------------------------------

    def fleet_id(self) -> str:
        """The fleet's id, made by the first coordinator that asks (all later ones agree)."""
        self._client.hsetnx(schema.FLEET_KEY, "id", os.urandom(4).hex())
        return cast(bytes, self._client.hget(schema.FLEET_KEY, "id")).decode()

    def next_worker_number(self) -> int:
        """0, 1, 2, ... across the fleet's whole life: a worker id is never given twice (a
        replacement is a new worker, and every coordinator must see it as one)."""
        return int(self._client.hincrby(schema.FLEET_KEY, "next_worker", 1)) - 1

    def claim_service(self, service: WorkerService) -> bool:
        """Register a service worker under its id; False if the id is taken (atomic)."""
        key = schema.service_key(service.worker_id)
        if not self._client.hsetnx(key, "actor_name", service.actor_name):
            return False
        fields = {
            "ray_namespace": service.ray_namespace,
            "num_gpus": repr(service.num_gpus),
            "config_json": service.config_json,
        }
        pipe = self._client.pipeline(transaction=True)
        pipe.hset(key, mapping=fields)
        pipe.sadd(schema.SERVICES_SET, service.worker_id)
        pipe.execute()
        return True

    def services(self) -> list[WorkerService]:
        out = []
        for raw in sorted(cast(set[bytes], self._client.smembers(schema.SERVICES_SET))):
            worker_id = raw.decode()
            h = {
                k.decode(): v.decode()
                for k, v in self._client.hgetall(schema.service_key(worker_id)).items()
            }
            if "config_json" not in h:
                continue  # being claimed right now
            out.append(
                WorkerService(
                    worker_id,
                    h["actor_name"],
                    h["ray_namespace"],
                    float(h["num_gpus"]),
                    h["config_json"],
                )
            )
        return out

    def remove_service(self, worker_id: str) -> None:
        pipe = self._client.pipeline(transaction=True)
        pipe.srem(schema.SERVICES_SET, worker_id)
        pipe.delete(schema.service_key(worker_id), schema.replacing_key(worker_id))
        pipe.execute()

    def claim_replacement(self, worker_id: str, ttl_s: float) -> bool:
        """True for exactly one caller per dead worker (within `ttl_s`)."""
        return bool(
            self._client.set(schema.replacing_key(worker_id), "1", nx=True, px=int(ttl_s * 1000))
        )

    def close(self) -> None:
        self._client.close()


def _pairs(flat: Sequence[Any]) -> Iterator[tuple[Any, Any]]:
    """A Lua-returned stream entry's fields ([k1, v1, k2, v2, ...]) as pairs."""
    return zip(flat[::2], flat[1::2], strict=True)
