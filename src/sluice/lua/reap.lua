-- reap: leases that expired without a heartbeat (the worker died or hung). The job goes back to the
-- head of its tenant's list at the current virtual time (FairQueue.push front=True) with a RETRY
-- event, or, once it has been started max_attempts times, fails for good into the dead letters.
-- Like BullMQ moveStalledJobsToWait, minus its two-phase stalled set: a lease here is a deadline.
--
-- KEYS[1] active zset   KEYS[2] deadline zset   KEYS[3] results zset   KEYS[4] dead zset
-- KEYS[5] running hash   KEYS[6] blocked set
-- ARGV[1] now   ARGV[2] queue prefix   ARGV[3] most leases to reap in this call   ARGV[4] result TTL s
-- ARGV[5] events kept per stream   ARGV[6] error JSON of an exhausted job, '{attempts}'
-- (sluice.core.errors.WORKER_LOST_ATTEMPTS) standing for the count
-- Returns {re-queued, dead-lettered, 1 when the bound was reached (call again) else 0}
-- (decoded by redis_codec.ReapReply).
-- Builds job, stream, tenant-list, tenant, state and marker keys and the models set from the prefix
-- (same slot as KEYS).

-- @include _keys.lua
-- @include _state.lua
-- @include _tenant.lua
-- @include _job.lua
-- @include _fairqueue.lua

local active_k, deadline_k, results_k, dead_k = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local running_k, blocked_k = KEYS[5], KEYS[6]
local now_s, P, limit = ARGV[1], ARGV[2], ARGV[3] * 1
local result_ttl, maxlen, worker_lost_error = ARGV[4] * 1, ARGV[5], ARGV[6]
local now = now_s * 1
J.P, J.now, J.now_s, J.ttl, J.maxlen = P, now, now_s, result_ttl, maxlen
J.results, J.running, J.blocked = results_k, running_k, blocked_k

local ids = rcall('ZRANGEBYSCORE', active_k, '-inf', now_s, 'LIMIT', 0, limit)
-- In the order the leases were taken ('ls', from claim), as the memory broker walks its leases:
-- two jobs of one tenant handed back in one round then keep the memory broker's order.
local lost = {}
for _, id in ipairs(ids) do
  rcall('ZREM', active_k, id)
  local f = job_read(job_key(P, id))
  f.id = id
  lost[#lost + 1] = f
end
table.sort(lost, function(a, b) return (a.ls or 0) * 1 < (b.ls or 0) * 1 end)
local requeued, dead = 0, 0
for _, f in ipairs(lost) do
  local id, jk = f.id, job_key(P, f.id)
  if f.state == 'running' then
    local attempts = f.attempts * 1
    if attempts >= f.max_attempts * 1 then
      rcall('ZADD', dead_k, now, id)
      -- (settle wakes the model's claimers when the lost job frees a capped tenant's slot)
      settle(id, f, 'failed', { 'error', (string.gsub(worker_lost_error, '{attempts}', tostring(attempts))) })
      dead = dead + 1
    else
      local model, cls, tenant = f.model, f.priority, f.tenant
      local seq = f.seq + 1
      rcall('HINCRBY', running_k, model, -1)
      tenant_move(P, blocked_k, tenant, 'running', 'queued')
      rcall('HSET', jk, 'state', 'queued', 'seq', seq)
      local st = st_open(state_key(P, model), {})
      fq_push(st, cls, sched_key(P, model, cls), tq_key(P, model, cls, tenant), tenant, id, f.cost * 1, true)
      st_flush(st)
      rcall('ZADD', deadline_k, f.deadline, id)
      emit(out_key(P, id), seq, 'retry', '{"attempt":' .. attempts .. ',"reason":"lease expired"}')
      rcall('ZADD', marker_key(P, model), 0, 'w')
      requeued = requeued + 1
    end
  end
end
local more = 0
if #ids == limit then more = 1 end
return { requeued, dead, more }
