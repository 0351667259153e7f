"""The Redis side of the index: key names and the scripts that change them atomically.

    kvmesh:{ns}:blk:{hash}         HASH   worker_id -> tier        who holds the block
    kvmesh:{ns}:node:{hash}        HASH   p, d, t                  radix metadata of a held block:
                                                                   parent hash, depth, tokens
    kvmesh:{ns}:epoch              STRING cache epoch (ClearCache bumps it; part of h_0)
    kvmesh:worker:{id}             HASH   generation, seq, model, node, device, pid, num_blocks, ...
    kvmesh:worker:{id}:blocks      HASH   hash -> tier             the worker's blocks (resync)
    kvmesh:worker:{id}:alive       STRING with TTL                 heartbeat
    kvmesh:workers                 SET    worker ids
    kvmesh:events                  STREAM field "b" = msgpack EventBatch (proto/events.py),
                                          or field "p" = id of a purged worker

Hashes are written as 16 lowercase hex digits (Lua numbers cannot hold 64 bits). `{ns}` is the
namespace of the model (its fingerprint hash), so one Redis can index several models, and a Redis
Cluster can shard by namespace. Every batch is applied by one script call: readers never see half
a batch, and a batch of a new generation first wipes the worker's previous blocks.

Radix metadata (`node` keys) lives exactly as long as some worker holds the block. A batch drops
the node of a block it removed only at its end, once no holder is left: a full re-publish (wipe,
then store everything again) and a demotion to the host tier (removed from the device, stored on
the host in the same batch) keep every link. A node is written from a stored event that names
its parent (`d` = 0 and `t` = 0 when the writer did not know the depth and the parent has no node).
Both keys of one block carry the namespace, so a Redis Cluster can place them together.
"""

from __future__ import annotations

PREFIX = "kvmesh"
EVENTS_STREAM = f"{PREFIX}:events"
WORKERS_SET = f"{PREFIX}:workers"
EVENTS_STREAM_MAXLEN = 200_000


FLEET_KEY = f"{PREFIX}:fleet"
"""HASH: `id` -> the fleet's id (names its worker actors in Ray), set once by the first comer."""
SERVICES_SET = f"{PREFIX}:services"
"""SET of worker ids running as long-lived services (what a coordinator attaches to)."""


def service_key(worker_id: str) -> str:
    """HASH: how to reach a service worker (Ray actor name and namespace) and its config."""
    return f"{PREFIX}:service:{worker_id}"


def replacing_key(worker_id: str) -> str:
    """STRING with TTL: one coordinator is replacing this dead worker (the others leave it)."""
    return f"{PREFIX}:service:{worker_id}:replacing"


def hash_hex(block_hash: int) -> str:
    return f"{block_hash:016x}"


def block_key(ns: str, block_hash_hex: str) -> str:
    return f"{PREFIX}:{ns}:blk:{block_hash_hex}"


def node_key(ns: str, block_hash_hex: str) -> str:
    """HASH of one block's radix metadata: `p` parent (16 hex digits), `d` depth, `t` tokens."""
    return f"{PREFIX}:{ns}:node:{block_hash_hex}"


def epoch_key(ns: str) -> str:
    """STRING: the namespace's cache epoch (absent: 0)."""
    return f"{PREFIX}:{ns}:epoch"


NO_PARENT_HEX = "0" * 16


def worker_key(worker_id: str) -> str:
    return f"{PREFIX}:worker:{worker_id}"


def worker_blocks_key(worker_id: str) -> str:
    return f"{PREFIX}:worker:{worker_id}:blocks"


def worker_alive_key(worker_id: str) -> str:
    return f"{PREFIX}:worker:{worker_id}:alive"


# Drop every block of one worker. Shared by APPLY_BATCH (new generation, cleared) and PURGE_WORKER.
# With `gone`, the dropped hashes are appended to it (their nodes are dropped at the batch's end,
# see `_DROP_ORPHAN_NODES`); without, a node whose block has no holder left goes at once.
_WIPE = """
local function wipe(ns, worker, gone)
  local wkey = 'kvmesh:worker:' .. worker .. ':blocks'
  local owned = redis.call('HKEYS', wkey)
  for _, h in ipairs(owned) do
    local bkey = 'kvmesh:' .. ns .. ':blk:' .. h
    redis.call('HDEL', bkey, worker)
    if gone then
      gone[#gone + 1] = h
    elseif redis.call('EXISTS', bkey) == 0 then
      redis.call('DEL', 'kvmesh:' .. ns .. ':node:' .. h)
    end
  end
  redis.call('DEL', wkey)
  return #owned
end
"""

_DROP_ORPHAN_NODES = """
local function drop_orphan_nodes(ns, gone)
  for _, h in ipairs(gone) do
    if redis.call('EXISTS', 'kvmesh:' .. ns .. ':blk:' .. h) == 0 then
      redis.call('DEL', 'kvmesh:' .. ns .. ':node:' .. h)
    end
  end
end
"""

# ARGV: ns, worker, generation, seq, payload, maxlen, then groups of
#   'S', tier, hashes, parent, depth    stored     'R', tier, hashes    removed     'C'    cleared
# where `hashes` is the concatenation of the blocks' 16-hex-digit names (one argument, not one
# per block: per-argument overhead dominated the client's cost), `parent` the 16-hex-digit parent
# of the first (NO_PARENT_HEX: unknown, no radix metadata written) and `depth` its depth (0:
# unknown). Returns the number of block events applied, or -1 for a stale / duplicate batch.
APPLY_BATCH = (
    _WIPE
    + _DROP_ORPHAN_NODES
    + """
local ns, worker, gen, seq = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local info = 'kvmesh:worker:' .. worker
local cur = redis.call('HMGET', info, 'generation', 'seq', 'block_size')
if cur[1] == gen and cur[2] and tonumber(cur[2]) >= seq then
  return -1
end
local gone = {}
if cur[1] ~= gen then
  wipe(ns, worker, gone)
end
local block_size = tonumber(cur[3]) or 0
local wkey = info .. ':blocks'
local prefix = 'kvmesh:' .. ns .. ':blk:'
local node_prefix = 'kvmesh:' .. ns .. ':node:'
local applied, i = 0, 7
while i <= #ARGV do
  local kind = ARGV[i]
  if kind == 'C' then
    wipe(ns, worker, gone)
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
drop_orphan_nodes(ns, gone)
redis.call('HSET', info, 'generation', gen, 'seq', seq, 'ns', ns)
redis.call('SADD', 'kvmesh:workers', worker)
redis.call('XADD', 'kvmesh:events', 'MAXLEN', '~', ARGV[6], '*', 'b', ARGV[5])
return applied
"""
)

# ARGV: ns (used when the worker never recorded its own), worker, maxlen. Removes the worker and
# everything it held, tells followers (stream field "p" = worker id); returns how many blocks
# were dropped.
PURGE_WORKER = (
    _WIPE
    + """
local ns = redis.call('HGET', 'kvmesh:worker:' .. ARGV[2], 'ns') or ARGV[1]
local n = wipe(ns, ARGV[2])
redis.call('DEL', 'kvmesh:worker:' .. ARGV[2], 'kvmesh:worker:' .. ARGV[2] .. ':alive')
redis.call('SREM', 'kvmesh:workers', ARGV[2])
redis.call('XADD', 'kvmesh:events', 'MAXLEN', '~', ARGV[3], '*', 'p', ARGV[2])
return n
"""
)
