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
-- ARGV[1] now   ARGV[2] job id   ARGV[3] worker id   ARGV[4] lease token ('' = any)
-- ARGV[5] terminal state
-- ARGV[6] tokens the engine reported using (-1: unknown), to settle the tenant's bucket with
--         (what the job was charged and did not use comes back; what it used beyond, is taken)
-- ARGV[7] the settings (settings_of in _keys.lua; RedisWork._finish_settings), joined by byte 31:
--   1 queue prefix   2 result TTL s   3 events kept per stream   4 drain EWMA weight
--   5 the quantile of DrainRate.slow (capacity.SLOW_QUANTILE)   6 its step (SLOW_STEP)
--   7 1 when the EWMA weight is per slot (DrainRate.weight: 4 over the model's slots),
--     0 when it is 4 as is (capacity.WEIGHT_PER_SLOT)
--   8 the weight of the newest job in the fill fit (capacity.FILL_ALPHA)
-- ARGV[8 ..] field, value pairs to record (result, usage, error, attempts, backend)
-- Returns {1, field, value, ...} the settled record (tenant, marker and models keys built from the prefix)
--         {0}  the lease is not the caller's (lost, re-delivered) or the job is no longer running
-- (decoded by redis_codec.JobReply)

-- @include _keys.lua
-- @include _tenant.lua
-- @include _job.lua
-- @include _drain.lua
-- @include _workers.lua

local job_k, active_k, results_k, running_k = KEYS[1], KEYS[3], KEYS[4], KEYS[5]
local capacity_k, blocked_k, workers_k, wslots_k = KEYS[6], KEYS[7], KEYS[8], KEYS[9]
-- The settings, parsed once per text (settings_of), with a memo of each model's capacity fields.
local function parse_settings(v)
  return {
    P = v[1], result_ttl = tonumber(v[2]), maxlen = v[3], drain_alpha = tonumber(v[4]),
    slow_q = tonumber(v[5]), slow_step = tonumber(v[6]), per_slot_weight = v[7] == '1',
    fill_alpha = tonumber(v[8]), fields = new_memo(PARTS_MAX),
  }
end
local S = settings_of('finish', ARGV[7], parse_settings)
-- A model's capacity fields: p:, n:, d:, h:, s:, g:, r: (the names of redis_keys.py)
local function capacity_fields(model)
  return S.fields.t[model] or memo_put(S.fields, model, {
    'p:' .. model, 'n:' .. model, 'd:' .. model, 'h:' .. model, 's:' .. model, 'g:' .. model, 'r:' .. model,
  })
end
local now_s, id, worker, token, state = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local used = ARGV[6] * 1
local P, result_ttl, maxlen, drain_alpha = S.P, S.result_ttl, S.maxlen, S.drain_alpha
local slow_q, slow_step, per_slot_weight, fill_alpha = S.slow_q, S.slow_step, S.per_slot_weight, S.fill_alpha
local CHANGES_AT = 8 -- ARGV[CHANGES_AT ..]: the field, value pairs to record
local now = now_s * 1
J.P, J.now, J.now_s, J.ttl, J.maxlen = P, now, now_s, result_ttl, maxlen
J.results, J.running, J.blocked = results_k, running_k, blocked_k

local f = job_read(job_k)
if f.worker ~= worker or (token ~= '' and f.lease ~= token) then return { 0 } end
if rcall('ZREM', active_k, id) == 0 then return { 0 } end -- not leased (any more)
if f.state ~= 'running' then return { 0 } end -- cancelled while running: the lease is released above

local changes = {}
for i = CHANGES_AT, #ARGV do changes[#changes + 1] = ARGV[i] end
local started = f.started_at
-- The model's running jobs, itself included, before settle counts it out (DrainRate.observe's
-- running: the mean of this and of the count just after it started, the job's 'rb').
local running_now = (rcall('HGET', running_k, f.model) or 0) * 1
-- (settle wakes the model's claimers when the end frees a capped tenant's slot: _job.lua)
settle(id, f, state, changes)
tenant_settle(P, f.tenant, f.kb, f.cost * 1, used, now)

if state == 'succeeded' and started then
  local cost, service = f.cost * 1, now - started
  if cost > 0 and service > 0 then
    local model = f.model
    local F = capacity_fields(model)
    local d = rcall('HMGET', capacity_k, F[1], F[2], F[3], F[4], F[5], F[6], 'e', F[7])
    if d[7] and now > d[7] * 1 then -- some worker may have died: recount the slots
      workers_refresh(workers_k, wslots_k, capacity_k, now_s)
      workers_mark(workers_k, capacity_k)
      d[5] = rcall('HGET', capacity_k, F[5])
    end
    local per_slot, samples = (d[1] or 0) * 1, (d[2] or 0) * 1
    local mean_s, slow = (d[3] or 0) * 1, (d[4] or 0) * 1
    local slots = math.max((d[5] or 0) * 1, 1)
    local alpha = drain_alpha -- DrainRate.weight
    if per_slot_weight then alpha = drain_alpha / slots end
    local per_cost = service / cost
    local resid = (d[8] or 0) * 1
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
    -- numbers, not num's texts (_keys.lua, int_text: Redis formats them for half the cost)
    local fields = { F[1], per_slot, F[2], int_text(samples + 1), F[3], mean_s, F[4], slow, F[7], resid }
    local rb = tonum(f.rb)
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
      fields[#fields + 1] = F[6]
      -- one string.format of the six (the count as table.concat wrote it, %.14g)
      fields[#fields + 1] = string.format('%.17g %.17g %.17g %.17g %.17g %.14g', g[1], g[2], g[3], g[4], g[5], g[6])
    end
    rcall('HSET', capacity_k, unpack(fields))
  end
end

return job_reply(f)
