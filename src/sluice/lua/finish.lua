-- finish: settle a running job in a terminal state, if the caller still holds its lease, and
-- publish its terminal event. A success feeds the model's drain rate (sluice.core.capacity.DrainRate:
-- a slot's rate, the EWMA of costs over that of service times, each job weighing alpha per slot of
-- the model (DrainRate.weight); the EWMA of service times; how slow
-- a job gets per cost unit, a quantile tracked on a log scale; the EWMA of the square of a job's
-- residual, its service time less cost / the rate before it (DrainRate.resid, field 'r:'); the fit of how a job slows as the batch fills, from the jobs running
-- beside it), which admit reads for its deadline prediction.
--
-- KEYS[1] job hash   KEYS[2] event stream   KEYS[3] active zset   KEYS[4] results zset
-- KEYS[5] running hash   KEYS[6] capacity hash   KEYS[7] blocked set   KEYS[8] workers zset
-- KEYS[9] worker slots hash (to recount the slots when a worker may have died, as admit does)
-- ARGV[1] now   ARGV[2] queue prefix   ARGV[3] job id   ARGV[4] worker id   ARGV[5] lease token ('' = any)
-- ARGV[6] terminal state   ARGV[7] result TTL s   ARGV[8] events kept per stream   ARGV[9] drain EWMA weight
-- ARGV[10] the quantile of DrainRate.slow (capacity.SLOW_QUANTILE)   ARGV[11] its step (SLOW_STEP)
-- ARGV[12] tokens the engine reported using (-1: unknown), to settle the tenant's bucket with
--          (what the job was charged and did not use comes back; what it used beyond, is taken)
-- ARGV[13] 1 when the EWMA weight is per slot (DrainRate.weight: ARGV[9] over the model's slots),
--          0 when it is ARGV[9] as is (capacity.WEIGHT_PER_SLOT)
-- ARGV[14] the weight of the newest job in the fill fit (capacity.FILL_ALPHA)
-- ARGV[15 ..] field, value pairs to record (result, usage, error, attempts, backend)
-- Returns {1, field, value, ...} the settled record (tenant key built from the prefix)
--         {0}  the lease is not the caller's (lost, re-delivered) or the job is no longer running
-- (decoded by redis_codec.JobReply)

-- @include _keys.lua
-- @include _tenant.lua
-- @include _job.lua
-- @include _drain.lua
-- @include _workers.lua

local job_k, active_k, results_k, running_k = KEYS[1], KEYS[3], KEYS[4], KEYS[5]
local capacity_k, blocked_k, workers_k, wslots_k = KEYS[6], KEYS[7], KEYS[8], KEYS[9]
local now_s, P, id, worker, token, state = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local result_ttl, maxlen, drain_alpha = tonumber(ARGV[7]), ARGV[8], tonumber(ARGV[9])
local slow_q, slow_step, used = tonumber(ARGV[10]), tonumber(ARGV[11]), tonumber(ARGV[12])
local per_slot_weight = ARGV[13] == '1'
local fill_alpha = tonumber(ARGV[14])
local CHANGES_AT = 15 -- ARGV[CHANGES_AT ..]: the field, value pairs to record
local now = tonumber(now_s)
J.P, J.now, J.now_s, J.ttl, J.maxlen = P, now, now_s, result_ttl, maxlen
J.results, J.running, J.blocked = results_k, running_k, blocked_k

local f = job_read(job_k)
if f.worker ~= worker or (token ~= '' and f.lease ~= token) then return { 0 } end
if redis.call('ZREM', active_k, id) == 0 then return { 0 } end -- not leased (any more)
if f.state ~= 'running' then return { 0 } end -- cancelled while running: the lease is released above

local changes = {}
for i = CHANGES_AT, #ARGV do changes[#changes + 1] = ARGV[i] end
local started = f.started_at
-- The model's running jobs, itself included, before settle counts it out (DrainRate.observe's
-- running: the mean of this and of the count just after it started, the job's 'rb').
local running_now = tonumber(redis.call('HGET', running_k, f.model)) or 0
settle(id, f, state, changes)
tenant_settle(P, f.tenant, f.kb, tonumber(f.cost), used, now)

if state == 'succeeded' and started then
  local cost, service = tonumber(f.cost), now - tonumber(started)
  if cost > 0 and service > 0 then
    local model = f.model
    local d = redis.call('HMGET', capacity_k, 'p:' .. model, 'n:' .. model, 'd:' .. model, 'h:' .. model,
      's:' .. model, 'g:' .. model, 'e', 'r:' .. model)
    if d[7] and now > tonumber(d[7]) then -- some worker may have died: recount the slots
      workers_refresh(workers_k, wslots_k, capacity_k, now_s)
      workers_mark(workers_k, capacity_k)
      d[5] = redis.call('HGET', capacity_k, 's:' .. model)
    end
    local per_slot, samples = tonumber(d[1]) or 0, tonumber(d[2]) or 0
    local mean_s, slow = tonumber(d[3]) or 0, tonumber(d[4]) or 0
    local slots = math.max(tonumber(d[5]) or 0, 1)
    local alpha = drain_alpha -- DrainRate.weight
    if per_slot_weight then alpha = drain_alpha / slots end
    local per_cost = service / cost
    local resid = tonumber(d[8]) or 0
    if samples > 0 and per_slot > 0 and mean_s > 0 then -- DrainRate.resid, before the rate learns it
      local r = service - cost / per_slot
      if resid <= 0 then resid = r * r else resid = resid + alpha * (r * r - resid) end
    end
    if samples == 0 or mean_s <= 0 then -- DrainRate.observe
      per_slot, mean_s = cost / service, service
    else
      local carried = per_slot * mean_s
      mean_s = mean_s + alpha * (service - mean_s)
      per_slot = (carried + alpha * (cost - carried)) / mean_s
    end
    if slow <= 0 then
      slow = per_cost
    elseif per_cost > slow then
      slow = slow * math.exp(slow_step * slow_q)
    else
      slow = slow * math.exp(-slow_step * (1 - slow_q))
    end
    local fields = { 'p:' .. model, num(per_slot), 'n:' .. model, samples + 1, 'd:' .. model, num(mean_s),
      'h:' .. model, num(slow), 'r:' .. model, num(resid) }
    local rb = tonumber(f.rb)
    local beside = rb and (rb + running_now) / 2
    if beside and beside > 0 then -- DrainRate.observe_fill
      local u = math.min(beside / slots, 1.0)
      local g = fill_fit(d[6])
      if #g < 6 or g[6] == 0 then
        g = { u, u, per_cost, u * u, u * per_cost, 0 }
      else
        g[1] = g[1] + alpha * (u - g[1])
        g[2] = g[2] + fill_alpha * (u - g[2])
        g[3] = g[3] + fill_alpha * (per_cost - g[3])
        g[4] = g[4] + fill_alpha * (u * u - g[4])
        g[5] = g[5] + fill_alpha * (u * per_cost - g[5])
      end
      g[6] = g[6] + 1
      fields[#fields + 1] = 'g:' .. model
      fields[#fields + 1] = table.concat({ num(g[1]), num(g[2]), num(g[3]), num(g[4]), num(g[5]), g[6] }, ' ')
    end
    redis.call('HSET', capacity_k, unpack(fields))
  end
end

return job_reply(f)
