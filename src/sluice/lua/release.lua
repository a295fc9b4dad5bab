-- release: hand back a job this worker claimed but will not run (its claim call was cancelled on
-- the way, e.g. at shutdown): back to the head of its tenant's list, as if never started, instead of
-- waiting a whole lease for reap (and being charged an attempt for it).
--
-- KEYS[1] job hash   KEYS[2] event stream   KEYS[3] active zset   KEYS[4] deadline zset
-- KEYS[5] running hash
-- ARGV[1] queue prefix   ARGV[2] job id   ARGV[3] worker id   ARGV[4] lease token
-- ARGV[5] events kept per stream
-- Returns 1 when released, 0 when the job was no longer this claim's.
-- Builds the tenant-list, fair-queue and marker keys from the prefix (same slot as KEYS).

-- @include _keys.lua
-- @include _job.lua
-- @include _fairqueue.lua

local P, id = ARGV[1], ARGV[2]
J.maxlen = ARGV[5]
local f = redis.call('HMGET', KEYS[1], 'state', 'worker', 'lease', 'model', 'priority', 'tenant', 'cost',
  'deadline', 'attempts')
if f[1] ~= 'running' or f[2] ~= ARGV[3] or f[3] ~= ARGV[4] or not redis.call('ZSCORE', KEYS[3], id) then
  return 0
end
local model, cls, tenant = f[4], f[5], f[6]
redis.call('ZREM', KEYS[3], id)
redis.call('HINCRBY', KEYS[5], model, -1)
local attempts = redis.call('HINCRBY', KEYS[1], 'attempts', -1)
redis.call('HSET', KEYS[1], 'state', 'queued')
redis.call('HDEL', KEYS[1], 'worker', 'lease')
fq_push(fq_key(P, model, cls), sched_key(P, model, cls), tq_key(P, model, cls, tenant), tenant, id,
  tonumber(f[7]), true)
redis.call('ZADD', KEYS[4], f[8], id)
emit(KEYS[1], KEYS[2], 'retry', '{"attempt":' .. (attempts + 1) .. ',"reason":"released unstarted"}')
redis.call('ZADD', marker_key(P, model), 0, 'w')
return 1
