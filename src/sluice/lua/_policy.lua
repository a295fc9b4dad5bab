-- Shared: the queue policies of sluice/core/policy.py, for admit.lua. A policy comes as its kind
-- (QueuePolicy.kind: 1 cap, 2 fifo, 3 deadline, 4 codel) and five numbers (QueuePolicy.lua_args).
-- codel's PolicyState lives in the model's state hash: 'pa' above_since, 'ps' standing_since,
-- 'pl' limit_s, 'pr' refused_at, each absent for None. Needs _state.lua. Every refusal comes with
-- its Retry-After as the core computes it, for the reservation admit.lua makes of it
-- (admission.reserve).

local POLICY_FIELDS = { 'pa', 'ps', 'pl', 'pr' }

-- The state as admit.lua hands it back on a refusal: the four fields, '' for None.
local function policy_state(st)
  local out = {}
  for i, f in ipairs(POLICY_FIELDS) do out[i] = st.v[f] or '' end
  return out
end

-- CoDelPolicy.observe; p = { target_s, interval_s, early_s, burst_rise, half_life_s }; target is
-- CoDelPolicy.target (target_s, or one job's drain time if longer); learning, policy.learning (the
-- drain rate has seen fewer than LEARNING_BATCHES batches of jobs finish: a queue above the
-- target for early_s is held to it, since the delay's rise is partly the rate's own learning).
local LEARNING_BATCHES = 2
-- policy.RISE_WINDOW: the rise is judged over at most this many early_s's (early_s 0: all the
-- time above), so that a burst whose queue stopped growing is not read as a slow rise.
local RISE_WINDOW = 2.0
local function codel_observe(st, p, target, delay, now, now_s, learning)
  local interval, early, rise, half_life = p[2], p[3], p[4], p[5]
  local above_since, standing_since = st_num(st, 'pa', nil), st_num(st, 'ps', nil)
  if delay <= target then
    if above_since then st_set(st, 'pa', false) end
    local refused_at = st_num(st, 'pr', nil)
    if standing_since and (refused_at == nil or now - refused_at >= half_life) then
      st_set(st, 'ps', false)
    end
    return
  end
  if above_since == nil then
    above_since = now
    st_set(st, 'pa', now_s)
  end
  if standing_since then return end
  local above = now - above_since
  local judged = above
  if early > 0 then judged = math.min(above, RISE_WINDOW * early) end
  if above >= early and (learning or delay - target < rise * judged) then -- mild: held to the target
    st_set(st, 'ps', now_s)
    if learning then st_set(st, 'pl', num(0)) else st_set(st, 'pl', num(target)) end
  elseif above >= interval then -- a burst keeps the queue it built
    st_set(st, 'ps', now_s)
    st_set(st, 'pl', num(delay))
  end
end

-- CoDelPolicy.delay_limit: nil while the queue is good.
local function codel_limit(st, p, target, now)
  local standing_since = st_num(st, 'ps', nil)
  if standing_since == nil then return nil end
  local half_life = p[5]
  local excess = math.max(st_num(st, 'pl', 0) - target, 0.0)
  return target + excess * math.pow(0.5, math.max(now - standing_since, 0.0) / half_life)
end

-- admission.clamp_retry_after; R = { min, max } Retry-After.
local function clamp_retry_after(x, R)
  if x ~= x or x == math.huge or x == -math.huge then return R[2] end
  return math.min(math.max(x, R[1]), R[2])
end

-- The policy's own decision after the hard bounds: nil to take the job, else the refusal's
-- Retry-After and whether to retry. Updates codel's state in st. q: wait_model, the wait at the
-- queue's tail; wait, the job's own; wait_one, one job's drain time; service, its own generation;
-- promised, that generation at the pace admission promises (DrainRate.slow_service_s); alone, at
-- the pace of a job with nothing ahead (what never fitting is judged by); budget,
-- the time to its deadline; measured, whether the drain rate is; samples, its finished jobs;
-- rate, the drain rate;
-- promise_rate, the rate a wait is promised at (DrainRate.promise_rate);
-- ahead_tokens; running, model_jobs, model_tokens and slots (cap and fifo); R the Retry-After bounds.
local function policy_refuses(st, kind, p, now, now_s, q)
  local R = q.R
  if kind == 1 then -- CapPolicy
    if q.running + q.model_jobs >= q.slots then
      return clamp_retry_after(q.service / math.max(q.slots, 1), R), true
    end
    return nil
  elseif kind == 2 then -- FifoPolicy
    if q.model_jobs >= p[1] then
      local avg = q.model_tokens / q.model_jobs
      return clamp_retry_after((q.model_jobs + 1 - p[1]) * avg / q.rate, R), true
    end
    return nil
  elseif kind == 4 then -- CoDelPolicy
    local target = math.max(p[1], q.wait_one)
    -- q.samples: the drain rate's finished jobs (absent: taken as learnt, the rule before it)
    local learning = q.samples ~= nil and q.samples < LEARNING_BATCHES * math.max(q.slots, 1)
    codel_observe(st, p, target, q.wait_model, now, now_s, learning)
    local limit = codel_limit(st, p, target, now)
    if limit and q.wait > limit then
      st_set(st, 'pr', now_s)
      return clamp_retry_after(q.wait, R), true
    end
  end
  -- admission.check_deadline: DeadlinePolicy, and CoDelPolicy's last check; the wait at the
  -- rate a wait is promised at (DrainRate.promise_rate)
  if q.measured and q.ahead_tokens / q.promise_rate + q.promised > q.budget then
    if q.alone > q.budget then return clamp_retry_after(q.alone, R), false end
    return clamp_retry_after(q.wait, R), true -- when the work queued ahead has started
  end
  return nil
end
