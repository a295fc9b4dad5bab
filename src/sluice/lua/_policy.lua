-- Shared: the queue policies of sluice/core/policy.py, for admit.lua. A policy comes as its kind
-- (QueuePolicy.kind: 1 cap, 2 fifo, 3 deadline, 4 codel) and five numbers (QueuePolicy.lua_args).
-- codel's PolicyState lives in the model's state hash: 'pa' above_since, 'ps' standing_since,
-- 'pl' limit_s, 'pr' refused_at, each absent for None. Needs _state.lua.

local POLICY_FIELDS = { 'pa', 'ps', 'pl', 'pr' }

-- The state as admit.lua hands it back on a refusal: the four fields, '' for None.
local function policy_state(st)
  local out = {}
  for i, f in ipairs(POLICY_FIELDS) do out[i] = st.v[f] or '' end
  return out
end

-- CoDelPolicy.observe; p = { target_s, interval_s, early_s, burst_rise, half_life_s }; target is
-- CoDelPolicy.target (target_s, or one job's drain time if longer).
local function codel_observe(st, p, target, delay, now, now_s)
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
  if above >= early and delay - target < rise * above then -- a mild overload: held to the target
    st_set(st, 'ps', now_s)
    st_set(st, 'pl', num(target))
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

-- The policy's own decision after the hard bounds: true to refuse. Updates codel's state in st.
-- wait_model: the wait at the queue's tail; wait: the job's own; wait_one: one job's drain time;
-- deadline_miss: the deadline check.
local function policy_refuses(st, kind, p, now, now_s, q)
  if kind == 1 then -- CapPolicy
    return q.running + q.model_jobs >= q.slots
  elseif kind == 2 then -- FifoPolicy
    return q.model_jobs >= p[1]
  elseif kind == 4 then -- CoDelPolicy
    local target = math.max(p[1], q.wait_one)
    codel_observe(st, p, target, q.wait_model, now, now_s)
    local limit = codel_limit(st, p, target, now)
    if limit and q.wait > limit then
      st_set(st, 'pr', now_s)
      return true
    end
  end
  return q.deadline_miss -- DeadlinePolicy, and CoDelPolicy's last check
end
