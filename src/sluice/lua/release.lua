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

local job_k, stream_k, active_k, deadline_k = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local running_k, blocked_k = KEYS[5], KEYS[6]
local P, id, worker, token = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
J.maxlen = ARGV[5]

local f = job_read(job_k)
if f.state ~= 'running' or f.worker ~= worker or f.lease ~= token then return 0 end
if rcall('ZREM', active_k, id) == 0 then return 0 end
local model, cls, tenant = f.model, f.priority, f.tenant
local attempts, seq = f.attempts - 1, f.seq + 1
rcall('HINCRBY', running_k, model, -1)
tenant_move(P, blocked_k, tenant, 'running', 'queued')
rcall('HSET', job_k, 'state', 'queued', 'attempts', attempts, 'seq', seq)
rcall('HDEL', job_k, 'worker', 'lease')
local st = st_open(state_key(P, model), {})
fq_push(st, cls, sched_key(P, model, cls), tq_key(P, model, cls, tenant), tenant, id, f.cost * 1, true)
st_flush(st)
rcall('ZADD', deadline_k, f.deadline, id)
emit(stream_k, seq, 'retry', '{"attempt":' .. (attempts + 1) .. ',"reason":"released unstarted"}')
rcall('ZADD', marker_key(P, model), 0, 'w')
return 1
