"""The Redis side of the index: key names and the scripts that change them atomically.

    kvmesh:{ns}:blk:{hash}         HASH   worker_id -> tier        who holds the block
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


def worker_key(worker_id: str) -> str:
    return f"{PREFIX}:worker:{worker_id}"


def worker_blocks_key(worker_id: str) -> str:
    return f"{PREFIX}:worker:{worker_id}:blocks"


def worker_alive_key(worker_id: str) -> str:
    return f"{PREFIX}:worker:{worker_id}:alive"


# Drop every block of one worker. Shared by APPLY_BATCH (new generation, cleared) and PURGE_WORKER.
_WIPE = """
local function wipe(ns, worker)
  local wkey = 'kvmesh:worker:' .. worker .. ':blocks'
  local owned = redis.call('HKEYS', wkey)
  for _, h in ipairs(owned) do
    redis.call('HDEL', 'kvmesh:' .. ns .. ':blk:' .. h, worker)
  end
  redis.call('DEL', wkey)
  return #owned
end
"""

# ARGV: ns, worker, generation, seq, payload, maxlen, then groups of
#   'S', tier, hashes    stored       'R', tier, hashes    removed       'C'    cleared
# where `hashes` is the concatenation of the blocks' 16-hex-digit names (one argument, not one
# per block: per-argument overhead dominated the client's cost). Returns the number of block
# events applied, or -1 for a stale / duplicate batch (not applied).
APPLY_BATCH = (
    _WIPE
    + """
local ns, worker, gen, seq = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local info = 'kvmesh:worker:' .. worker
local cur = redis.call('HMGET', info, 'generation', 'seq')
if cur[1] == gen and cur[2] and tonumber(cur[2]) >= seq then
  return -1
end
if cur[1] ~= gen then
  wipe(ns, worker)
end
local wkey = info .. ':blocks'
local prefix = 'kvmesh:' .. ns .. ':blk:'
local applied, i = 0, 7
while i <= #ARGV do
  local kind = ARGV[i]
  if kind == 'C' then
    wipe(ns, worker)
    i = i + 1
  else
    local tier, blob = ARGV[i + 1], ARGV[i + 2]
    local n = #blob / 16
    local fields = {}
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
      elseif redis.call('HGET', wkey, h) == tier then
        redis.call('HDEL', prefix .. h, worker)
        redis.call('HDEL', wkey, h)
      end
    end
    if #fields > 0 then
      redis.call('HSET', wkey, unpack(fields))
    end
    applied = applied + n
    i = i + 3
  end
end
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
