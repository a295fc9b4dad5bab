-- cancel: a queued job leaves its fair queue; a running one is marked cancelled at once and its
-- worker is told on the abort channel (the lease stays until the worker hears of it, by that
-- message or its next heartbeat). A terminal job is left as it is.
--
-- KEYS[1] job hash   KEYS[2] event stream   KEYS[3] deadline zset   KEYS[4] results zset
-- KEYS[5] running hash
-- ARGV[1] now   ARGV[2] queue prefix   ARGV[3] job id   ARGV[4] result TTL s
-- ARGV[5] events kept per stream   ARGV[6] abort channel   ARGV[7] error JSON of a cancelled job
-- Returns {1, field, value, ...} the record after the request; {0} when the job is unknown.
-- Builds the tenant-list and fair-queue keys of a queued job from the prefix (same slot as KEYS).

-- @include _keys.lua
-- @include _job.lua
-- @include _fairqueue.lua

local now_s, P, id = ARGV[1], ARGV[2], ARGV[3]
J.P, J.now, J.now_s, J.ttl, J.maxlen = P, tonumber(now_s), now_s, tonumber(ARGV[4]), ARGV[5]
J.results, J.running = KEYS[4], KEYS[5]

local f = redis.call('HMGET', KEYS[1], 'state', 'model', 'priority', 'tenant', 'cost')
if not f[1] then return { 0 } end
if f[1] == 'queued' then
  fq_remove(fq_key(P, f[2], f[3]), tq_key(P, f[2], f[3], f[4]), id, tonumber(f[5]))
  redis.call('ZREM', KEYS[3], id)
  settle(id, 'cancelled', ARGV[7])
elseif f[1] == 'running' then
  redis.call('PUBLISH', ARGV[6], id)
  settle(id, 'cancelled', ARGV[7])
end
local out = redis.call('HGETALL', KEYS[1])
table.insert(out, 1, 1)
return out
