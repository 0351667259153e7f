"""The Redis side of the index: key names and the scripts that change them atomically.

The index is split into `NUM_INDEX_SHARDS` shards by worker: every key a worker's events touch
carries its shard's hash tag (`{sNN}`, or `{sNN.k}`: see `_shard_tag`), so on a Redis Cluster
they all sit in one slot and one script call can change them atomically; the shards spread over
the cluster's masters. On a single Redis (the default) the tags are just part of the names.

    kvmesh:{sNN}:{ns}:blk:{hash}   HASH   worker_id -> tier        who (of shard NN) holds it
    kvmesh:{sNN}:{ns}:node:{hash}  HASH   p, d, t                  radix metadata of a block held
                                                                   in shard NN: parent hash,
                                                                   depth, tokens
    kvmesh:{sNN}:worker:{id}       HASH   generation, seq, ns, model, node, device, pid, ...
    kvmesh:{sNN}:worker:{id}:blocks  HASH hash -> tier             the worker's blocks (resync)
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
`index_shard(worker_id)`. The holders of one block are spread over the shards of the workers
that hold it; the mirror, not Redis, answers "who holds this prefix". Each shard's stream is
ordered, and a worker's batches all go to its own shard's stream, so per-worker order (all the
mirror needs) holds. Hashes are written as 16 lowercase hex digits (Lua numbers cannot hold 64
bits); `ns` is the namespace of the model (its fingerprint hash). Every batch is applied by one
script call: readers never see half a batch, and a batch of a new generation first wipes the
worker's previous blocks. The epoch key is one per namespace, outside every shard: it is read
and written on its own, never inside a script.

Radix metadata (`node` keys) is kept per shard, beside the shard's block keys, so the script
that changes a block's holders keeps its node in the same slot: a block held by workers of
several shards has a node in each (they agree: the parent and depth follow from the hash chain),
and a node lives exactly as long as some worker *of its shard* holds the block. Readers take any
shard's node. A batch drops the node of a block it removed only at its end, once the shard has
no holder left: a full re-publish (wipe, then store everything again) and a demotion to the host
tier (removed from the device, stored on the host in the same batch) keep every link. A node is
written from a stored event that names its parent (`d` = 0 and `t` = 0 when the writer did not
know the depth and the parent has no node in the shard).
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


def block_key(ns: str, block_hash_hex: str, worker_id: str) -> str:
    """HASH of the holders of one block among the workers of `worker_id`'s shard."""
    return shard_block_key(index_shard(worker_id), ns, block_hash_hex)


def shard_block_key(shard: int, ns: str, block_hash_hex: str) -> str:
    """HASH of the holders of one block among the workers of `shard`."""
    return f"{shard_prefix(shard)}{ns}:blk:{block_hash_hex}"


def node_key(ns: str, block_hash_hex: str, worker_id: str) -> str:
    """HASH of one block's radix metadata in `worker_id`'s shard: `p` parent (16 hex digits),
    `d` depth, `t` tokens."""
    return shard_node_key(index_shard(worker_id), ns, block_hash_hex)


def shard_node_key(shard: int, ns: str, block_hash_hex: str) -> str:
    """HASH of one block's radix metadata in `shard` (present while a worker of it holds it)."""
    return f"{shard_prefix(shard)}{ns}:node:{block_hash_hex}"


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
    """KEYS of `APPLY_BATCH` for one worker (all in its shard's slot)."""
    s = index_shard(worker_id)
    return [worker_key(worker_id), worker_blocks_key(worker_id), workers_key(s), events_key(s)]


def purge_worker_keys(worker_id: str) -> list[str]:
    """KEYS of `PURGE_WORKER` for one worker (all in its shard's slot)."""
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


# Drop every block of one worker. Shared by APPLY_BATCH (new generation, cleared) and PURGE_WORKER.
# `prefix` is the worker's shard prefix and namespace (`kvmesh:{sNN}:{ns}:`), `wkey` its blocks
# HASH. With `gone`, the dropped hashes are appended to it (their nodes are dropped at the
# batch's end, see `_DROP_ORPHAN_NODES`); without, a node whose block has no holder left in the
# shard goes at once.
_WIPE = """
local function wipe(prefix, wkey, gone)
  local owned = redis.call('HKEYS', wkey)
  for _, h in ipairs(owned) do
    local bkey = prefix .. 'blk:' .. h
    redis.call('HDEL', bkey, ARGV[2])
    if gone then
      gone[#gone + 1] = h
    elseif redis.call('EXISTS', bkey) == 0 then
      redis.call('DEL', prefix .. 'node:' .. h)
    end
  end
  redis.call('DEL', wkey)
  return #owned
end
"""

_DROP_ORPHAN_NODES = """
local function drop_orphan_nodes(prefix, gone)
  for _, h in ipairs(gone) do
    if redis.call('EXISTS', prefix .. 'blk:' .. h) == 0 then
      redis.call('DEL', prefix .. 'node:' .. h)
    end
  end
end
"""

# KEYS: apply_batch_keys(worker). ARGV: ns, worker, generation, seq, payload, maxlen, shard
# prefix, then groups of
#   'S', tier, hashes, parent, depth    stored     'R', tier, hashes    removed     'C'    cleared
# where `hashes` is the concatenation of the blocks' 16-hex-digit names (one argument, not one
# per block: per-argument overhead dominated the client's cost), `parent` the 16-hex-digit parent
# of the first (NO_PARENT_HEX: unknown, no radix metadata written) and `depth` its depth (0:
# unknown; then the parent's node in the shard, if any, gives it). The worker HASH's `block_size`
# turns depths into tokens. Returns the number of block events applied, or -1 for a stale /
# duplicate batch.
APPLY_BATCH = (
    _WIPE
    + _DROP_ORPHAN_NODES
    + """
local ns, worker, gen, seq = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local info, wkey = KEYS[1], KEYS[2]
local cur = redis.call('HMGET', info, 'generation', 'seq', 'ns', 'block_size')
if cur[1] == gen and cur[2] and tonumber(cur[2]) >= seq then
  return -1
end
local ns_prefix = ARGV[7] .. ns .. ':'
local gone = {}
if cur[1] ~= gen then
  local old_ns = cur[3] or ns
  if old_ns == ns then
    wipe(ns_prefix, wkey, gone)
  else
    wipe(ARGV[7] .. old_ns .. ':', wkey, nil)  -- no block of another namespace comes back
  end
end
local block_size = tonumber(cur[4]) or 0
local prefix = ns_prefix .. 'blk:'
local node_prefix = ns_prefix .. 'node:'
local applied, i = 0, 8
while i <= #ARGV do
  local kind = ARGV[i]
  if kind == 'C' then
    wipe(ns_prefix, wkey, gone)
    i = i + 1
  else
    local tier, blob = ARGV[i + 1], ARGV[i + 2]
    local n = #blob / 16
    local fields = {}
    local parent, depth = nil, 0
    if kind == 'S' then
      parent, depth = ARGV[i + 3], tonumber(ARGV[i + 4])
      if parent == string.rep('0', 16) then  -- NO_PARENT_HEX
        parent = nil
      elseif depth == 0 then
        local parent_depth = tonumber(redis.call('HGET', node_prefix .. parent, 'd')) or 0
        if parent_depth > 0 then
          depth = parent_depth + 1
        end
      end
    end
    for k = 0, n - 1 do
      local h = string.sub(blob, k * 16 + 1, k * 16 + 16)
      if kind == 'S' then
        redis.call('HSET', prefix .. h, worker, tier)
        fields[#fields + 1] = h
        fields[#fields + 1] = tier
        if #fields >= 1000 then
          redis.call('HSET', wkey, unpack(fields))
          fields = {}
        end
        if parent then
          local d = depth > 0 and depth + k or 0
          local nkey = node_prefix .. h
          if d > 0 or redis.call('EXISTS', nkey) == 0 then
            redis.call('HSET', nkey, 'p', parent, 'd', d, 't', d * block_size)
          end
          parent = h
        end
      elseif redis.call('HGET', wkey, h) == tier then
        redis.call('HDEL', prefix .. h, worker)
        redis.call('HDEL', wkey, h)
        gone[#gone + 1] = h
      end
    end
    if #fields > 0 then
      redis.call('HSET', wkey, unpack(fields))
    end
    applied = applied + n
    i = i + (kind == 'S' and 5 or 3)
  end
end
drop_orphan_nodes(ns_prefix, gone)
redis.call('HSET', info, 'generation', gen, 'seq', seq, 'ns', ns)
redis.call('SADD', KEYS[3], worker)
redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[6], '*', 'b', ARGV[5])
return applied
"""
)

# KEYS: purge_worker_keys(worker). ARGV: ns (used when the worker never recorded its own),
# worker, maxlen, shard prefix. Removes the worker and everything it held, tells followers
# (stream field "p" = worker id); returns how many blocks were dropped.
PURGE_WORKER = (
    _WIPE
    + """
local ns = redis.call('HGET', KEYS[1], 'ns') or ARGV[1]
local n = wipe(ARGV[4] .. ns .. ':', KEYS[2])
redis.call('DEL', KEYS[1], KEYS[5])
redis.call('SREM', KEYS[3], ARGV[2])
redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[3], '*', 'p', ARGV[2])
return n
"""
)

# KEYS: feeder_key(engine). ARGV: owner, ttl_ms. Take the claim if free, renew it if ours;
# returns 1 when `owner` holds it now, 0 when another coordinator does.
CLAIM_FEED = """
local cur = redis.call('GET', KEYS[1])
if cur == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if not cur then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""

# KEYS: feeder_key(engine). ARGV: owner. Let go of the claim if ours (a clean stop hands the
# engine to another coordinator at once, not after the TTL).
RELEASE_FEED = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""
