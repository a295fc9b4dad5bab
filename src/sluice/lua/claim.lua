-- claim: take the next job of one of the worker's models and lease it (like BullMQ moveToActive).
-- Across models: the highest class first, then the oldest head job, then the model name (as the
-- memory broker). Inside a model: next_class, then the fair queue of that class. A job found past its
-- deadline is expired instead and the search goes on, up to a bound per call.
--
-- KEYS[1] active zset   KEYS[2] deadline zset   KEYS[3] results zset   KEYS[4] running hash
-- then per model, in ARGV order, a block of 2 + 2*ncls keys:
--   credit hash, marker zset, fq hash of every class (highest first), sched zset of every class
-- ARGV[1] now   ARGV[2] queue prefix   ARGV[3] lease seconds   ARGV[4] worker id   ARGV[5] lease token
-- ARGV[6] result TTL s   ARGV[7] events kept per stream   ARGV[8] ncls   ARGV[9] nmodels
-- ARGV[10] most expired jobs to settle in this call   ARGV[11] error JSON of an expired job
-- then ncls class names, ncls class minimum shares, nmodels model names
-- Returns {1, field, value, ...} the leased job's record
--         {0}                    nothing to claim
--         {2}                    the bound of expired jobs was reached: call again
-- Builds tenant-list, job and stream keys from the prefix (same slot as KEYS).

-- @include _keys.lua
-- @include _job.lua
-- @include _fairqueue.lua
-- @include _classes.lua

local now_s, P = ARGV[1], ARGV[2]
local now = tonumber(now_s)
local lease_s, worker, token = tonumber(ARGV[3]), ARGV[4], ARGV[5]
local ncls, nmodels, max_expired = tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10])
local expired_error = ARGV[11]
J.P, J.now, J.now_s, J.ttl, J.maxlen = P, now, now_s, tonumber(ARGV[6]), ARGV[7]
J.results, J.running = KEYS[3], KEYS[4]

local classes, mins, models = {}, {}, {}
for i = 1, ncls do
  classes[i] = ARGV[11 + i]
  mins[i] = tonumber(ARGV[11 + ncls + i])
end
for m = 1, nmodels do models[m] = ARGV[11 + 2 * ncls + m] end

local function block(m) return 4 + (m - 1) * (2 + 2 * ncls) end
local function fq_of(m, i) return KEYS[block(m) + 2 + i] end
local function sched_of(m, i) return KEYS[block(m) + 2 + ncls + i] end

local function counts_of(m)
  local counts = {}
  for i = 1, ncls do
    counts[i] = tonumber(redis.call('HGET', fq_of(m, i), 'jobs')) or 0
  end
  return counts
end

local function credits_of(m)
  local raw = redis.call('HMGET', KEYS[block(m) + 1], unpack(classes))
  local credits = {}
  for i = 1, ncls do credits[i] = tonumber(raw[i]) or 0.0 end
  return credits
end

local expired = 0
while true do
  -- the best head over the models: {class index, created_at, model name, m, head, counts, credits}
  local best = nil
  for m = 1, nmodels do
    local counts = counts_of(m)
    local any = false
    for i = 1, ncls do any = any or counts[i] > 0 end
    if any then
      local credits = credits_of(m)
      local i = next_class(counts, credits)
      local head = fq_peek(P, fq_of(m, i), sched_of(m, i), models[m], classes[i])
      if head then
        local created = 0
        if nmodels > 1 then
          created = tonumber(redis.call('HGET', job_key(P, head[5]), 'created_at'))
        end
        if best == nil or i < best[1] or (i == best[1] and (created < best[2]
            or (created == best[2] and models[m] < best[3]))) then
          best = { i, created, models[m], m, head, counts, credits }
        end
      end
    end
  end
  if best == nil then return { 0 } end

  local i, m, head = best[1], best[4], best[5]
  local id = head[5]
  local jk = job_key(P, id)
  local f = redis.call('HMGET', jk, 'cost', 'deadline', 'weight')
  fq_pop(fq_of(m, i), sched_of(m, i), head, tonumber(f[1]), tonumber(f[3]) or 1.0)
  local credits, args = pay_credits(best[6], best[7], mins, i), {}
  for c = 1, ncls do
    args[#args + 1] = classes[c]
    args[#args + 1] = credits[c]
  end
  redis.call('HSET', KEYS[block(m) + 1], unpack(args))
  redis.call('ZREM', KEYS[2], id)

  if tonumber(f[2]) <= now then
    settle(id, 'expired', expired_error)
    expired = expired + 1
    if expired >= max_expired then return { 2 } end
  else
    redis.call('HSET', jk, 'state', 'running', 'started_at', now_s, 'worker', worker, 'lease', token)
    local attempt = redis.call('HINCRBY', jk, 'attempts', 1)
    local model = models[m]
    redis.call('HINCRBY', KEYS[4], model, 1)
    redis.call('ZADD', KEYS[1], now + lease_s, id)
    emit(jk, out_key(P, id), 'started', '{"attempt":' .. attempt .. '}')
    -- Work left: wake one more idle claimer, so that a burst does not wait behind a single marker.
    for mm = 1, nmodels do
      local counts = counts_of(mm)
      for c = 1, ncls do
        if counts[c] > 0 then
          redis.call('ZADD', KEYS[block(mm) + 2], 0, 'w')
          break
        end
      end
    end
    local out = redis.call('HGETALL', jk)
    table.insert(out, 1, 1)
    return out
  end
end
