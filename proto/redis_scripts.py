"""The Lua scripts that change the index's Redis keys (`redis_schema.py`) atomically."""

from __future__ import annotations

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
