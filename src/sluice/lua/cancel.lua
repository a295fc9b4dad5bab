-- cancel: a queued job leaves its fair queue; a running one is marked cancelled at once and its
-- worker is told on the abort channel (the lease stays until the worker hears of it, by that
-- message or its next heartbeat). A terminal job is left as it is.
--
-- KEYS[1] job hash   KEYS[2] deadline zset   KEYS[3] results zset   KEYS[4] running hash
-- KEYS[5] blocked set
-- ARGV[1] now   ARGV[2] queue prefix   ARGV[3] job id   ARGV[4] result TTL s
-- ARGV[5] events kept per stream   ARGV[6] abort channel   ARGV[7] error JSON of a cancelled job
-- Returns {1, field, value, ...} the record after the request; {0} when the job is unknown
-- (decoded by redis_codec.JobReply).
-- Builds the stream, tenant-list, tenant, state and marker keys of the job, and the models set, from
-- the prefix (same slot as KEYS).

-- @include _keys.lua
-- @include _state.lua
-- @include _tenant.lua
-- @include _job.lua
-- @include _fairqueue.lua

local job_k, deadline_k, results_k, running_k, blocked_k = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local now_s, P, id, result_ttl, maxlen = ARGV[1], ARGV[2], ARGV[3], ARGV[4] * 1, ARGV[5]
local abort_channel, cancelled_error = ARGV[6], ARGV[7]
J.P, J.now, J.now_s, J.ttl, J.maxlen = P, now_s * 1, now_s, result_ttl, maxlen
J.results, J.running, J.blocked = results_k, running_k, blocked_k

local f = job_read(job_k)
if not f.state then return { 0 } end
if f.state == 'queued' then
  local st = st_open(state_key(P, f.model), {})
  fq_remove(st, f.priority, tq_key(P, f.model, f.priority, f.tenant), id, f.cost * 1)
  st_flush(st)
  rcall('ZREM', deadline_k, id)
  settle(id, f, 'cancelled', { 'error', cancelled_error })
elseif f.state == 'running' then
  rcall('PUBLISH', abort_channel, id)
  settle(id, f, 'cancelled', { 'error', cancelled_error }) -- wakes claimers for a freed capped slot
end
return job_reply(f)
