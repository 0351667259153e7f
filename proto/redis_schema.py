"""The Redis side of the index: its key names and the values it stores (the scripts that change
them atomically are `redis_scripts.py`).

The index is split into `NUM_INDEX_SHARDS` shards by worker: every key a worker's events touch
carries its shard's hash tag (`{sNN}`, or `{sNN.k}`: see `_shard_tag`), so on a Redis Cluster
they all sit in one slot and one script call can change them atomically; the shards spread over
the cluster's masters. On a single Redis (the default) the tags are just part of the names.

    kvmesh:{sNN}:worker:{id}       HASH   generation, seq, ns, model, node, device, pid, ...
    kvmesh:{sNN}:worker:{id}:blocks  HASH hash -> tier, parent, depth   the worker's blocks and
                                                                   their radix links: the index
    kvmesh:{sNN}:worker:{id}:alive STRING with TTL                 heartbeat
    kvmesh:{sNN}:worker:{id}:feeder STRING with TTL                the coordinator that feeds an
                                                                   external engine's events
    kvmesh:{sNN}:workers           SET    ids of the shard's workers
    kvmesh:{sNN}:events            STREAM field "b" = msgpack EventBatch (proto/events.py),
                                          or field "p" = id of a purged worker,
                                          or field "r" = msgpack NoteBatch of a worker's
                                          requests (proto/request_notes.py)
    kvmesh:{ns}:epoch              STRING cache epoch (ClearCache bumps it; part of h_0)
    kvmesh:{fleet}:...             the service directory (one slot: claimed in transactions)

(`{sNN}` is a literal hash tag; `{ns}`, `{hash}`, `{id}` stand for values.) A worker's shard is
`index_shard(worker_id)`. Each field of a worker's blocks HASH is a block's hash (16 lowercase
hex digits: Lua numbers cannot hold 64 bits), its value `block_value(tier, parent, depth)`: 25
characters, the tier digit, the parent's 16 hex digits (NO_PARENT_HEX: unknown) and the depth in
8 hex digits (1 = a prompt's first block; 0 = unknown). The worker's HASH is the only per-block
state: who holds a block is the mirror's question (it follows the streams), and a cold reader
gets a block's radix link from the snapshot of any worker that holds it, so a link lives exactly
as long as some worker holds the block. Each shard's stream is ordered, and a worker's batches
all go to its own shard's stream, so per-worker order (all the mirror needs) holds. `ns` is the
namespace of the model (its fingerprint hash); a worker holds blocks of one namespace, its
`ns`. Every batch is applied by one script call: readers never see half a batch, and a batch of
a new generation first wipes the worker's previous blocks. The epoch key is one per namespace,
outside every shard: it is read and written on its own, never inside a script.

A stored event that does not name its parent (a block demoted to the host tier, a full
re-publish of the host tier) leaves a block's link as it was, also when the same batch removed
the block first (a demotion: removed from the device, stored on the host) or wiped it (a full
re-publish); a stored event that names the parent but not the depth takes the depth from the
parent's value in the worker's HASH.

Before this layout, the index also kept a holder HASH (`kvmesh:{sNN}:{ns}:blk:{hash}`, worker ->
tier) and a radix node HASH (`kvmesh:{sNN}:{ns}:node:{hash}`) per block and shard, and a
worker's blocks HASH held one-digit values. Readers take both layouts (a one-digit value has no
link); a wipe of an old-layout HASH (a worker's new generation, a clear, a purge) also drops its
holder and node keys. Upgrade coordinators first (they read both layouts), then workers: an old
worker's keys go when it is purged, or when it restarts under its id (its first batch is a new
generation, which wipes them).
"""

from __future__ import annotations

import binascii
import zlib
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

PREFIX = "kvmesh"
EVENTS_STREAM_MAXLEN = 200_000
NUM_INDEX_SHARDS = 16
"""Shards of the index (fixed: changing it moves every worker's keys)."""

_FLEET_TAG = f"{PREFIX}:{{fleet}}"
FLEET_KEY = f"{_FLEET_TAG}:fleet"
"""HASH: `id` -> the fleet's id (names its worker actors in Ray), set once by the first comer."""
SERVICES_SET = f"{_FLEET_TAG}:services"
"""SET of worker ids running as long-lived services (what a coordinator attaches to)."""


_DECISIONS_TAG = f"{PREFIX}:{{decisions}}"
DECISIONS_SEQ_KEY = f"{_DECISIONS_TAG}:seq"
"""STRING: the decision log's sequence (entries committed so far, fleet-wide)."""
DECISIONS_STREAM = f"{_DECISIONS_TAG}:log"
"""STREAM: the decision log; entry id `<seq>-0`, field `d` a placement (`proto/placements.py`).
One hash tag with the sequence, so the commit script touches one slot on a cluster."""
DECISIONS_STREAM_MAXLEN = 100_000


def service_key(worker_id: str) -> str:
    """HASH: how to reach a service worker (Ray actor name and namespace) and its config."""
    return f"{_FLEET_TAG}:service:{worker_id}"


def replacing_key(worker_id: str) -> str:
    """STRING with TTL: one coordinator is replacing this dead worker (the others leave it)."""
    return f"{_FLEET_TAG}:service:{worker_id}:replacing"


def hash_hex(block_hash: int) -> str:
    return f"{block_hash:016x}"


def index_shard(worker_id: str) -> int:
    """The shard of a worker's keys: stable across processes and runs (CRC-32 of the id)."""
    return zlib.crc32(worker_id.encode()) % NUM_INDEX_SHARDS


_NUM_CLUSTER_SLOTS = 16384


def _shard_tag(shard: int) -> str:
    """`s07`, or `s07.<n>` with the first n that puts the tag's cluster slot (CRC16-XMODEM, as
    Redis Cluster hashes) in the shard's sixteenth of the slots: the shards then sit in equal
    slot ranges, so a cluster whose masters own equal ranges gets them evenly."""
    low = shard * _NUM_CLUSTER_SLOTS // NUM_INDEX_SHARDS
    high = (shard + 1) * _NUM_CLUSTER_SLOTS // NUM_INDEX_SHARDS
    n = 0
    while True:
        tag = f"s{shard:02d}" if n == 0 else f"s{shard:02d}.{n}"
        if low <= binascii.crc_hqx(tag.encode(), 0) % _NUM_CLUSTER_SLOTS < high:
            return tag
        n += 1


_SHARD_PREFIXES = tuple(f"{PREFIX}:{{{_shard_tag(s)}}}:" for s in range(NUM_INDEX_SHARDS))


def shard_prefix(shard: int) -> str:
    """What every key of `shard` starts with, its hash tag included: `kvmesh:{s07.12}:`."""
    if not 0 <= shard < NUM_INDEX_SHARDS:
        raise ValueError(f"shard must be in [0, {NUM_INDEX_SHARDS}), got {shard}")
    return _SHARD_PREFIXES[shard]


def _worker_prefix(worker_id: str) -> str:
    return shard_prefix(index_shard(worker_id))


def epoch_key(ns: str) -> str:
    """STRING: the namespace's cache epoch (absent: 0); one key for every shard."""
    return f"{PREFIX}:{ns}:epoch"


NO_PARENT_HEX = "0" * 16


def worker_key(worker_id: str) -> str:
    return f"{_worker_prefix(worker_id)}worker:{worker_id}"


def worker_blocks_key(worker_id: str) -> str:
    return f"{_worker_prefix(worker_id)}worker:{worker_id}:blocks"


def feeder_key(worker_id: str) -> str:
    """STRING with TTL: which coordinator publishes an external engine's events (one at a time:
    two feeds of one engine would wipe each other's generations)."""
    return f"{_worker_prefix(worker_id)}worker:{worker_id}:feeder"


def worker_alive_key(worker_id: str) -> str:
    return f"{_worker_prefix(worker_id)}worker:{worker_id}:alive"


def workers_key(shard: int) -> str:
    """SET of the ids of the workers of `shard`."""
    return f"{shard_prefix(shard)}workers"


def events_key(shard: int) -> str:
    """STREAM of `shard`'s event batches, purge notices and request notes."""
    return f"{shard_prefix(shard)}events"


def worker_events_key(worker_id: str) -> str:
    return events_key(index_shard(worker_id))


EVENTS_STREAMS = tuple(events_key(s) for s in range(NUM_INDEX_SHARDS))
"""Every shard's stream, in shard order."""


def apply_batch_keys(worker_id: str) -> list[str]:
    """KEYS of `redis_scripts.APPLY_BATCH` for one worker (all in its shard's slot)."""
    s = index_shard(worker_id)
    return [worker_key(worker_id), worker_blocks_key(worker_id), workers_key(s), events_key(s)]


def purge_worker_keys(worker_id: str) -> list[str]:
    """KEYS of `redis_scripts.PURGE_WORKER` for one worker (all in its shard's slot)."""
    return apply_batch_keys(worker_id) + [worker_alive_key(worker_id)]


def cluster_url(url: str) -> tuple[str, bool]:
    """(`url` without its `cluster` query flag, whether it names a Redis Cluster). A cluster is
    named by any of its nodes with `?cluster=1` (`redis://:pw@host:7000/0?cluster=1`)."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    flags = [v for k, v in query if k == "cluster"]
    rest = urlencode([(k, v) for k, v in query if k != "cluster"])
    is_cluster = bool(flags) and flags[-1].lower() in ("1", "true", "yes")
    return urlunsplit(parts._replace(query=rest)), is_cluster


LINK_LEN = 24
"""Characters of a block's link in a worker's blocks HASH: parent (16 hex digits, NO_PARENT_HEX
when unknown) and depth (8 hex digits, 0 when unknown)."""
BLOCK_VALUE_LEN = 1 + LINK_LEN
"""Characters of a block's value in a worker's blocks HASH: its tier (one digit), then its link."""
MAX_LINK_DEPTH = 0xFFFF_FFFF
"""The deepest depth a link records (8 hex digits); a deeper block's depth is written as 0."""
NO_LINK = "0" * LINK_LEN


def block_value(tier: int, parent_hash: int, depth: int) -> str:
    """A block's value in its worker's blocks HASH (`BLOCK_VALUE_LEN` characters)."""
    if not 0 <= tier <= 9:
        raise ValueError(f"tier must be one digit, got {tier}")
    depth = depth if 0 <= depth <= MAX_LINK_DEPTH else 0
    return f"{tier}{parent_hash:016x}{depth:08x}"
