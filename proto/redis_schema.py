"""The Redis side of the index: key names and the scripts that change them atomically.

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


# Shared helpers of the scripts below. A block's value is `BLOCK_VALUE_LEN` characters (tier,
# parent, depth); a worker HASH written before links moved into it holds one-digit values (the
# tier) and has a holder key (`blk:`) and a radix node (`node:`) per block in its shard: `wipe`
# drops those too, so a Redis that old workers wrote is cleaned up by the new workers' first
# batches (a new generation) or by purges.
_BLOCK_VALUES = """
local NO_PARENT = string.rep('0', 16)
local NO_LINK = string.rep('0', 24)
local CHUNK = 4000  -- values per redis.call: Lua's unpack stops at 8000

-- A value's link (parent and depth), or nil when it has none.
local function link_of(v)
  if v and #v == 25 and string.sub(v, 2, 17) ~= NO_PARENT then
    return string.sub(v, 2)
  end
  return nil
end

local function split(blob)
  local out = {}
  for k = 0, #blob / 16 - 1 do
    out[k + 1] = string.sub(blob, k * 16 + 1, k * 16 + 16)
  end
  return out
end

-- HMGET of many fields, in chunks.
local function hmget(key, fields)
  local out = {}
  for first = 1, #fields, CHUNK do
    local last = math.min(first + CHUNK - 1, #fields)
    local got = redis.call('HMGET', key, unpack(fields, first, last))
    for k = 1, #got do
      out[first + k - 1] = got[k]
    end
  end
  return out
end

local function call_chunked(cmd, key, args)
  for first = 1, #args, CHUNK do
    redis.call(cmd, key, unpack(args, first, math.min(first + CHUNK - 1, #args)))
  end
end

-- Drop every block of one worker; returns how many. `legacy_prefix` is the worker's shard
-- prefix and namespace (`kvmesh:{sNN}:{ns}:`), for a HASH in the layout before links. With
-- `kept`, the dropped values are recorded in it (hash -> value): a block stored again later in
-- the same batch without a link keeps its old one.
local function wipe(legacy_prefix, wkey, worker, kept)
  local sample = redis.call('HRANDFIELD', wkey, 1, 'WITHVALUES')
  if #sample == 0 then
    return 0
  end
  local n
  if #sample[2] == 1 then
    local owned = redis.call('HKEYS', wkey)
    for _, h in ipairs(owned) do
      local bkey = legacy_prefix .. 'blk:' .. h
      redis.call('HDEL', bkey, worker)
      if redis.call('EXISTS', bkey) == 0 then
        redis.call('DEL', legacy_prefix .. 'node:' .. h)
      end
    end
    n = #owned
  elseif kept then
    local all = redis.call('HGETALL', wkey)
    for j = 1, #all, 2 do
      kept[all[j]] = all[j + 1]
    end
    n = #all / 2
  else
    n = redis.call('HLEN', wkey)
  end
  redis.call('UNLINK', wkey)
  return n
end
"""

# The values of one stored event that did not come ready from the writer: the parent is
# unknown (each block keeps the link it has in the worker's HASH or had earlier in the batch),
# or the depth is (then the parent's value in the worker's HASH gives it, and a block that has
# a link keeps it).
_WORKED_OUT_VALUES = """
local function worked_out_values(wkey, kept, tier, hashes, parent, depth)
  local old = hmget(wkey, hashes)
  local function link(k)
    return link_of(old[k]) or (kept and link_of(kept[hashes[k]]))
  end
  local values = {}
  if parent == NO_PARENT then
    local unlinked = tier .. NO_LINK
    for k = 1, #hashes do
      local l = link(k)
      values[k] = l and tier .. l or unlinked
    end
    return values
  end
  if depth == 0 then
    local pv = redis.call('HGET', wkey, parent) or (kept and kept[parent])
    local pd = link_of(pv) and tonumber(string.sub(pv, 18, 25), 16) or 0
    if pd > 0 and pd + #hashes <= 0xffffffff then
      depth = pd + 1
    end
  end
  local prev = parent
  for k = 1, #hashes do
    if depth > 0 then
      values[k] = tier .. prev .. string.format('%08x', depth + k - 1)
    else
      values[k] = tier .. (link(k) or (prev .. '00000000'))
    end
    prev = hashes[k]
  end
  return values
end
"""

# KEYS: apply_batch_keys(worker). ARGV: ns, worker, generation, seq, payload, maxlen, shard
# prefix, '1' if a stored event below may keep links the batch drops ('' if not), then groups of
#   'S', tier, hashes, values, parent, depth      stored
#   'R', tier, hashes                             removed
#   'C'                                           cleared
# where `hashes` is the concatenation of the blocks' 16-hex-digit names (one argument, not one
# per block: per-argument overhead dominated the client's cost), and `values` the blocks'
# values (`block_value`) concatenated, worked out by the writer when it knew the parent and the
# depth; when it did not (`values` empty), the script works them out from `parent` (of the
# first block; NO_PARENT_HEX: unknown) and `depth` (0: unknown). A block's value goes into the
# worker's HASH only: no per-block key, so a 256-block batch is a handful of variadic calls.
# Returns the number of block events applied, or -1 for a stale / duplicate batch.
APPLY_BATCH = (
    _BLOCK_VALUES
    + _WORKED_OUT_VALUES
    + """
local ns, worker, gen, seq = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local info, wkey = KEYS[1], KEYS[2]
local cur = redis.call('HMGET', info, 'generation', 'seq', 'ns')
if cur[1] == gen and cur[2] and tonumber(cur[2]) >= seq then
  return -1
end
local kept = nil
if ARGV[8] == '1' then
  kept = {}
end
if cur[1] ~= gen then
  local old_ns = cur[3] or ns
  wipe(ARGV[7] .. old_ns .. ':', wkey, worker, old_ns == ns and kept or nil)
end
local legacy_prefix = ARGV[7] .. ns .. ':'
local applied, i = 0, 9
while i <= #ARGV do
  local kind = ARGV[i]
  if kind == 'C' then
    wipe(legacy_prefix, wkey, worker, kept)
    i = i + 1
  elseif kind == 'S' then
    local tier, blob, values = ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
    local n = #blob / 16
    local fields = {}
    if values ~= '' then
      for k = 0, n - 1 do
        fields[2 * k + 1] = string.sub(blob, k * 16 + 1, k * 16 + 16)
        fields[2 * k + 2] = string.sub(values, k * 25 + 1, k * 25 + 25)
      end
    else
      local hashes = split(blob)
      local worked = worked_out_values(wkey, kept, tier, hashes, ARGV[i + 4], tonumber(ARGV[i + 5]))
      for k = 1, n do
        fields[2 * k - 1] = hashes[k]
        fields[2 * k] = worked[k]
      end
    end
    call_chunked('HSET', wkey, fields)
    applied = applied + n
    i = i + 6
  else
    local tier, hashes = ARGV[i + 1], split(ARGV[i + 2])
    local old = hmget(wkey, hashes)
    local gone = {}
    for k = 1, #hashes do
      local v = old[k]
      if v and string.sub(v, 1, 1) == tier then
        gone[#gone + 1] = hashes[k]
        if kept then
          kept[hashes[k]] = v
        end
      end
    end
    call_chunked('HDEL', wkey, gone)
    applied = applied + #hashes
    i = i + 3
  end
end
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
    _BLOCK_VALUES
    + """
local ns = redis.call('HGET', KEYS[1], 'ns') or ARGV[1]
local n = wipe(ARGV[4] .. ns .. ':', KEYS[2], ARGV[2], nil)
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
