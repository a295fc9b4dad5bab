-- claim: take the next job of one of the worker's models and lease it (like BullMQ moveToActive),
-- a mirror of the memory broker's _pop and claim. Across models: the highest class first, then the
-- oldest head job, then the model name. Inside a model: next_class, then the fair queue of that
-- class, passing over the tenants at their concurrency cap. A job found past its deadline, or with
-- less time left than its generation needs at the measured rate, is expired instead and the search
-- goes on, up to a bound per call.
--
-- KEYS[1] active zset   KEYS[2] deadline zset   KEYS[3] results zset   KEYS[4] running hash
-- KEYS[5] blocked set   KEYS[6] capacity hash (drain rates; 'ls' counts the leases taken)
-- then per model, in ARGV order, a block of 2 + ncls keys:
--   state hash, marker zset, sched zset of every class (highest first)
-- ARGV[1] now   ARGV[2] worker id   ARGV[3] lease token
-- ARGV[4] 1 when the caller was woken by a marker (it passes the wake-up on), else 0
-- ARGV[5] the settings (settings_of in _keys.lua; ClaimPlan.settings), joined by byte 31:
--   1 queue prefix  2 lease seconds  3 result TTL s  4 events kept per stream  5 ncls  6 nmodels
--   7 most expired jobs to settle in this call  8 error JSON of an expired job
--   9 error JSON of a job dropped at dispatch, '{left}' (sluice.core.errors.UNFINISHABLE_LEFT)
--     standing for the seconds it had left
--   10 capacity.FILL_RIDGE  11 capacity.MAX_FILL_SLOWDOWN (DrainRate.slowdown)
--   then ncls class names, ncls class minimum shares, nmodels model names
-- Returns {1, field, value, ...} the leased job's record
--         {0}                    nothing to claim
--         {2}                    the bound of expired jobs was reached: call again
-- (decoded by redis_codec.JobReply)
-- Builds tenant-list, tenant, job and stream keys from the prefix (same slot as KEYS).

-- @include _keys.lua
-- @include _state.lua
-- @include _tenant.lua
-- @include _job.lua
-- @include _fairqueue.lua
-- @include _classes.lua
-- @include _drain.lua

local active_k, deadline_k, results_k, running_k = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local blocked_k, capacity_k = KEYS[5], KEYS[6]
local MODEL_KEYS_AT = 7 -- KEYS[MODEL_KEYS_AT ..]: the blocks of keys per model

-- The settings, parsed once per text (settings_of), with the state fields every claim reads and
-- the capacity hash's fields of each model.
local function parse_settings(v)
  local s = { P = v[1], lease_s = tonumber(v[2]), result_ttl = tonumber(v[3]), maxlen = v[4] }
  s.ncls, s.nmodels, s.max_expired = tonumber(v[5]), tonumber(v[6]), tonumber(v[7])
  s.expired_error, s.unfinishable_error = v[8], v[9]
  s.fill_ridge, s.max_slowdown = tonumber(v[10]), tonumber(v[11])
  local NAMES_AT = 12 -- v[NAMES_AT ..]: class names, minimum shares, model names
  s.classes, s.mins, s.models, s.capacity_fields = {}, {}, {}, {}
  for i = 1, s.ncls do
    s.classes[i] = v[NAMES_AT - 1 + i]
    s.mins[i] = tonumber(v[NAMES_AT - 1 + s.ncls + i])
  end
  for m = 1, s.nmodels do
    local model = v[NAMES_AT - 1 + 2 * s.ncls + m]
    s.models[m], s.capacity_fields[m] = model, { 'p:' .. model, 'n:' .. model, 'g:' .. model }
  end
  s.fields = class_fields(s.classes)
  return s
end
local S = settings_of('claim', ARGV[5], parse_settings)

local now_s, P = ARGV[1], S.P
local now = now_s * 1
local lease_s, worker, token = S.lease_s, ARGV[2], ARGV[3]
local result_ttl, maxlen = S.result_ttl, S.maxlen
local ncls, nmodels, max_expired = S.ncls, S.nmodels, S.max_expired
local expired_error, woken, unfinishable_error = S.expired_error, ARGV[4] == '1', S.unfinishable_error
local fill_ridge, max_slowdown = S.fill_ridge, S.max_slowdown
J.P, J.now, J.now_s, J.ttl, J.maxlen = P, now, now_s, result_ttl, maxlen
J.results, J.running, J.blocked = results_k, running_k, blocked_k

local classes, mins, models, fields = S.classes, S.mins, S.models, S.fields

-- The keys of model m: its state hash, its marker, then the sched zset of class i.
local function model_key(m, j) return KEYS[MODEL_KEYS_AT + (m - 1) * (2 + ncls) + j] end
local function state_of(m) return model_key(m, 0) end
local function marker_of(m) return model_key(m, 1) end
local function sched_of(m, i) return model_key(m, 1 + i) end

local blocked = {}
for _, t in ipairs(rcall('SMEMBERS', blocked_k)) do blocked[t] = true end

-- Per model: its state view, and its queue lengths and credits by class index.
local states, counts, credits = {}, {}, {}
for m = 1, nmodels do
  local st = st_open(state_of(m), fields)
  states[m], counts[m], credits[m] = st, {}, {}
  for i, c in ipairs(classes) do
    counts[m][i] = st_num(st, f_jobs(c), 0)
    credits[m][i] = st_num(st, f_credit(c), 0.0)
  end
end

local function eligible_of(m)
  local out = {}
  for i, c in ipairs(classes) do
    out[i] = fq_has_eligible(P, states[m], models[m], c, sched_of(m, i), blocked, counts[m][i])
  end
  return out
end

-- fq_peek's common case in a read of one heap entry instead of sixteen (every entry read costs a
-- score formatted by Redis and parsed back here): the top entry is current and its tenant may run.
-- Anything else (a stale entry, a blocked tenant) goes to fq_peek, which settles it.
local function peek(m, i)
  local st, c, sched = states[m], classes[i], sched_of(m, i)
  local top = rcall('ZRANGE', sched, '0', '0', 'WITHSCORES')
  if #top == 0 then return nil end
  local member, tag = top[1], top[2] * 1
  local tenant = string.sub(member, 16)
  if not blocked[tenant] and st_num(st, f_tag(c, tenant), nil) == tag then
    local tq = tq_key(P, models[m], c, tenant)
    local id = rcall('LINDEX', tq, '0')
    if id then return { member, tag, tenant, tq, id, top[2] } end
  end
  return fq_peek(P, st, models[m], c, sched, blocked)
end

local expired = 0
while true do
  -- the best head over the models: {class index, created_at, model name, m, head, eligible}
  local best = nil
  for m = 1, nmodels do
    local eligible = eligible_of(m)
    local i = next_class(eligible, credits[m])
    if i then
      local head = peek(m, i)
      if head then
        local created = 0
        if nmodels > 1 then
          created = tonum(rcall('HGET', job_key(P, head[5]), 'created_at'))
        end
        if best == nil or i < best[1] or (i == best[1] and (created < best[2]
            or (created == best[2] and models[m] < best[3]))) then
          best = { i, created, models[m], m, head, eligible }
        end
      end
    end
  end
  if best == nil then return { 0 } end

  local i, m, head = best[1], best[4], best[5]
  local st, id = states[m], head[5]
  local jk = job_key(P, id)
  local f = job_read(jk)
  fq_pop(st, classes[i], sched_of(m, i), head, f.cost * 1, (f.weight or 1.0) * 1)
  counts[m][i] = counts[m][i] - 1
  local paid = pay_credits(best[6], counts[m], credits[m], mins, i)
  for c = 1, ncls do
    if paid[c] ~= credits[m][c] then
      credits[m][c] = paid[c]
      st_set(st, f_credit(classes[c]), paid[c])
    end
  end
  st_flush(st)
  rcall('ZREM', deadline_k, id)

  -- DrainRate.service_s at the measured rate in a full batch (slot_rate); before any measurement
  -- only the deadline counts.
  local left, service = f.deadline - now, nil
  if left > 0 then
    local d = rcall('HMGET', capacity_k, unpack(S.capacity_fields[m])) -- p:, n:, g:
    if (d[2] or 0) * 1 > 0 then
      -- The slowdown is at most max_slowdown, so service is at most `longest`: a job with more
      -- time left than that can finish whatever the fill fit says, and the fit is not parsed
      -- (the common case; the answer is the same).
      local per_slot, cost = d[1] * 1, f.cost * 1
      local longest = cost / math.max(per_slot / math.max(max_slowdown, 1), 1e-3)
      if left < longest then
        service = cost / math.max(per_slot / fill_slowdown(d[3], fill_ridge, max_slowdown), 1e-3)
      end
    end
  end
  if left <= 0 or (service and left < service) then
    local err = expired_error
    if left > 0 then -- it would be aborted half-way: the engine's time goes to a job that can finish
      err = string.gsub(unfinishable_error, '{left}', string.format('%.1f', left))
    end
    settle(id, f, 'expired', { 'error', err })
    expired = expired + 1
    if expired >= max_expired then return { 2 } end
  else
    local attempt, seq = f.attempts + 1, f.seq + 1
    local ls = rcall('HINCRBY', capacity_k, 'ls', '1') -- the order leases are taken in (reap.lua)
    local rb = rcall('HINCRBY', running_k, models[m], '1') -- running with it at its start, itself too
    job_set(jk, f, { 'state', 'running', 'started_at', now_s, 'worker', worker, 'lease', token,
      'attempts', int_text(attempt), 'seq', int_text(seq), 'ls', ls, 'rb', int_text(rb) })
    tenant_move(P, blocked_k, f.tenant, 'queued', 'running')
    rcall('ZADD', active_k, now + lease_s, id, 'inf', SKIPLIST_MEMBER)
    emit(out_key(P, id), seq, 'started', '{"attempt":' .. attempt .. '}')
    -- A claimer that was idle wakes the next idle one while work is left, so that a burst does not
    -- wait behind a single marker. Busy claimers come back by themselves and consume no markers,
    -- so only woken ones need to pass it on.
    if woken then
      for mm = 1, nmodels do
        for c = 1, ncls do
          if counts[mm][c] > 0 then
            rcall('ZADD', marker_of(mm), '0', 'w')
            break
          end
        end
      end
    end
    return job_reply(f)
  end
end
