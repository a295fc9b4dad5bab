-- Shared by admit, claim and finish: the fill fit of sluice.core.capacity.DrainRate, kept in the
-- capacity hash's field 'g:<model>' (redis_keys.drain_fill_field) as six numbers, space-separated:
-- fill, fit_u, fit_t, fit_uu, fit_ut, fills.

-- The six numbers of a 'g:' field ({} when absent).
local function fill_fit(text)
  local g = {}
  for x in string.gmatch(text or '', '%S+') do g[#g + 1] = x * 1 end
  return g
end

-- DrainRate.slowdown: how much slower a job runs in a full batch than at the fill the rate was
-- measured at (1 when never told a fill), from the six numbers fill_fit read.
local function fit_slowdown(g, ridge, max_slowdown)
  if #g < 6 or g[6] == 0 or g[3] <= 0 then return 1.0 end
  local var = math.max(g[4] - g[2] * g[2], 0)
  local cov = g[5] - g[2] * g[3]
  local slope = math.max(cov, 0) / (var + ridge)
  local at_fill = g[3] + slope * (g[1] - g[2])
  local at_full = g[3] + slope * (1 - g[2])
  if at_fill <= 0 then return max_slowdown end
  return math.min(math.max(at_full / at_fill, 1), max_slowdown)
end

-- fit_slowdown of a 'g:' field's text.
local function fill_slowdown(text, ridge, max_slowdown)
  return fit_slowdown(fill_fit(text), ridge, max_slowdown)
end

-- DrainRate.spread: how much a job's time per cost unit varies, relative to the mean (0 before any
-- measurement).
local function time_spread(per_slot, slow, samples)
  if samples <= 0 then return 0 end
  return math.max(slow * per_slot - 1, 0) / 2
end

-- DrainRate.residual_spread: how much a job's service time strays from what its cost predicts at
-- the rate, relative to the mean service time: the root of the capacity hash's 'r:<model>' field
-- (DrainRate.resid, s^2, which finish keeps; redis_keys.drain_resid_field) over its 'd:<model>'
-- (DrainRate.service), or spread (time_spread's) while either is 0 or absent (before a second job
-- finished). The promised wait's margin reads it.
local function residual_spread(resid, service, spread)
  if resid and service and resid > 0 and service > 0 then return math.sqrt(resid) / service end
  return spread
end

-- DrainRate.promise_slowdown: fill_slowdown moved toward the most a full batch can slow a job
-- (1 / fill, within max_slowdown) by share (capacity.EXTRAPOLATION_SHARE) times the spread, or by
-- gap_share (capacity.FILL_GAP_SHARE) times the fill not measured (1 - fit_u - gap_sd standard
-- deviations of the fills, capacity.FILL_GAP_SD), the larger (at most all the way), on a log
-- scale. g: fill_fit's numbers, fit: fit_slowdown's of them (admit has both already: the field is
-- parsed once an admission).
local function promise_slowdown(g, fit, max_slowdown, share, spread, gap_share, gap_sd)
  if #g < 6 or g[6] == 0 then return fit end
  local bound = math.min(math.max(1 / math.max(g[1], 1e-3), fit), max_slowdown)
  local by_gap = gap_share * (1 - g[2] - gap_sd * math.sqrt(math.max(g[4] - g[2] * g[2], 0)))
  return fit * math.pow(bound / fit, math.min(math.max(share * spread, by_gap), 1))
end

-- DrainRate.promise_rate_behind's margin: z (capacity.WAIT_MARGIN_Z) standard errors of two means:
-- the rate, a mean over about 2 / weight jobs (the weight of DrainRate.weight: alpha per slot when
-- per_slot_weight) whose times vary by spread (time_spread's), and the ahead_jobs queued ahead, a
-- sample of their own whose service times stray from what their costs predict by residual
-- (residual_spread's; spread when nil), variance residual^2 / ahead_jobs (none when 0).
local function wait_margin(spread, samples, slots, alpha, per_slot_weight, z, ahead_jobs, residual)
  if samples <= 0 then return 1.0 end
  local w = alpha
  if per_slot_weight then w = alpha / math.max(slots, 1) end
  local jobs = math.min(samples, (2 - w) / w)
  local own = 0
  if ahead_jobs > 0 then
    residual = residual or spread
    own = residual * residual / ahead_jobs
  end
  return 1 + z * math.sqrt(spread * spread / jobs + own)
end
