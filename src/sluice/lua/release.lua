-- release: hand back a job this worker claimed but will not run (its claim call was cancelled on
-- the way, e.g. at shutdown): back to the head of its tenant's list, as if never started, instead of
-- waiting a whole lease for reap (and being charged an attempt for it).
--
-- KEYS[1] job hash   KEYS[2] event stream   KEYS[3] active zset   KEYS[4] deadline zset
-- KEYS[5] running hash   KEYS[6] blocked set
-- ARGV[1] queue prefix   ARGV[2] job id   ARGV[3] worker id   ARGV[4] lease token
-- ARGV[5] events kept per stream
-- Returns 1 when released, 0 when the job was no longer this claim's.
-- Builds the tenant-list, tenant, state and marker keys from the prefix (same slot as KEYS).

-- @include _keys.lua
-- @include _state.lua
-- @include _tenant.lua
-- @include _job.lua
-- @include _fairqueue.lua

local P, id = ARGV[1], ARGV[2]
J.maxlen = ARGV[5]
local f = job_read(KEYS[1])
if f.state ~= 'running' or f.worker ~= ARGV[3] or f.lease ~= ARGV[4] then return 0 end
if redis.call('ZREM', KEYS[3], id) == 0 then return 0 end
local model, cls, tenant = f.model, f.priority, f.tenant
local attempts, seq = tonumber(f.attempts) - 1, tonumber(f.seq) + 1
redis.call('HINCRBY', KEYS[5], model, -1)
tenant_move(P, KEYS[6], tenant, 'running', 'queued')
redis.call('HSET', KEYS[1], 'state', 'queued', 'attempts', attempts, 'seq', seq)
redis.call('HDEL', KEYS[1], 'worker', 'lease')
local st = st_open(state_key(P, model), {})
fq_push(st, cls, sched_key(P, model, cls), tq_key(P, model, cls, tenant), tenant, id, tonumber(f.cost), true)
st_flush(st)
redis.call('ZADD', KEYS[4], f.deadline, id)
emit(KEYS[2], seq, 'retry', '{"attempt":' .. (attempts + 1) .. ',"reason":"released unstarted"}')
redis.call('ZADD', marker_key(P, model), 0, 'w')
return 1
