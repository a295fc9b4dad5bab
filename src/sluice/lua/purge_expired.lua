-- purge_expired: queued jobs past their deadline turn EXPIRED (before any worker spends time on
-- them; claim checks too, this frees their queue room sooner), and finished jobs past their result
-- TTL are dropped with their events and dead-letter entry.
--
-- KEYS[1] deadline zset   KEYS[2] results zset   KEYS[3] dead zset   KEYS[4] running hash
-- KEYS[5] blocked set
-- ARGV[1] now   ARGV[2] queue prefix   ARGV[3] most jobs of each kind in this call   ARGV[4] result TTL s
-- ARGV[5] events kept per stream   ARGV[6] error JSON of an expired job
-- Returns {expired, dropped, 1 when a bound was reached (call again) else 0}
-- (decoded by redis_codec.PurgeExpiredReply).
-- Builds job, stream, tenant-list, tenant and state keys from the prefix (same slot as KEYS).

-- @include _keys.lua
-- @include _state.lua
-- @include _tenant.lua
-- @include _job.lua
-- @include _fairqueue.lua

local deadline_k, results_k, dead_k, running_k, blocked_k = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local now_s, P, limit = ARGV[1], ARGV[2], ARGV[3] * 1
local result_ttl, maxlen, expired_error = ARGV[4] * 1, ARGV[5], ARGV[6]
J.P, J.now, J.now_s, J.ttl, J.maxlen = P, now_s * 1, now_s, result_ttl, maxlen
J.results, J.running, J.blocked = results_k, running_k, blocked_k

local late = rcall('ZRANGEBYSCORE', deadline_k, '-inf', now_s, 'LIMIT', 0, limit)
local expired = 0
for _, id in ipairs(late) do
  rcall('ZREM', deadline_k, id)
  local f = job_read(job_key(P, id))
  if f.state == 'queued' then
    local st = st_open(state_key(P, f.model), {})
    fq_remove(st, f.priority, tq_key(P, f.model, f.priority, f.tenant), id, f.cost * 1)
    st_flush(st)
    settle(id, f, 'expired', { 'error', expired_error })
    expired = expired + 1
  end
end

local old = rcall('ZRANGEBYSCORE', results_k, '-inf', now_s, 'LIMIT', 0, limit)
for _, id in ipairs(old) do
  rcall('DEL', job_key(P, id), out_key(P, id))
  rcall('ZREM', results_k, id)
  rcall('ZREM', dead_k, id)
end

local more = 0
if #late == limit or #old == limit then more = 1 end
return { expired, #old, more }
