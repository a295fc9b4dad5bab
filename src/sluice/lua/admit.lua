-- admit: idempotency, bounds and the deadline prediction, then the enqueue: all or nothing.
-- Mirrors sluice.core.admission.check; on refusal it returns the numbers that check() needs, and
-- Python re-runs check() on them to raise the same Refused (status, code, message, Retry-After).
--
-- KEYS[1]  job hash                 KEYS[2]  event stream of the job
-- KEYS[3]  the tenant's list        KEYS[4]  sched zset of the job's class
-- KEYS[5]  idempotency key (KEYS[1] again when the job has none)
-- KEYS[6]  deadline zset            KEYS[7]  models set         KEYS[8]  drain hash
-- KEYS[9]  workers zset             KEYS[10] worker slots hash  KEYS[11] slots hash
-- KEYS[12] marker of the model
-- KEYS[13 .. 12+ncls]  fq hash of every class of the model, highest class first
-- ARGV[1]  now                      ARGV[2]  queue prefix       ARGV[3]  job id
-- ARGV[4]  model                    ARGV[5]  tenant             ARGV[6]  class index (1-based)
-- ARGV[7]  number of classes        ARGV[8]  cost               ARGV[9]  deadline
-- ARGV[10] model max jobs           ARGV[11] model max tokens   (-1: unbounded)
-- ARGV[12] class max jobs           ARGV[13] class max tokens   (-1: unbounded)
-- ARGV[14] drain prior per slot     ARGV[15] idempotency TTL s (0: no key)
-- ARGV[16] events kept per stream
-- ARGV[17 ..] field, value pairs of the job record (Python's encoding, see sluice.broker.redis)
-- Returns {1, position, estimated_start_s}           queued
--         {2, first job id}                          the idempotency key names an earlier live job
--         {3}                                        this job id is already admitted (a retried call)
--         {0, model_jobs, model_tokens, class_jobs, class_tokens, ahead_jobs, ahead_tokens,
--             per_slot, samples, slots}              refused
-- Reads the earlier job's record for idempotency (built from the prefix, same slot).

-- @include _keys.lua
-- @include _fairqueue.lua
-- @include _workers.lua

local now_s, P, id, model, tenant = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local now = tonumber(now_s)
local ci, ncls = tonumber(ARGV[6]), tonumber(ARGV[7])
local cost, deadline = tonumber(ARGV[8]), tonumber(ARGV[9])
local idem_ttl = tonumber(ARGV[15])

if redis.call('EXISTS', KEYS[1]) == 1 then return { 3 } end

if idem_ttl > 0 then
  local hit = redis.call('GET', KEYS[5])
  if hit then
    local sp = string.find(hit, ' ', 1, true)
    local first = string.sub(hit, 1, sp - 1)
    if tonumber(string.sub(hit, sp + 1)) > now and redis.call('EXISTS', job_key(P, first)) == 1 then
      return { 2, first }
    end
  end
end

local model_jobs, model_tokens, class_jobs, class_tokens, ahead_jobs, ahead_tokens = 0, 0, 0, 0, 0, 0
for i = 1, ncls do
  local c = redis.call('HMGET', KEYS[12 + i], 'jobs', 'tokens')
  local j, t = tonumber(c[1]) or 0, tonumber(c[2]) or 0
  model_jobs, model_tokens = model_jobs + j, model_tokens + t
  if i <= ci then ahead_jobs, ahead_tokens = ahead_jobs + j, ahead_tokens + t end
  if i == ci then class_jobs, class_tokens = j, t end
end

local d = redis.call('HMGET', KEYS[8], 'p:' .. model, 'n:' .. model)
local per_slot, samples = tonumber(d[1]) or 0, tonumber(d[2]) or 0
workers_refresh(KEYS[9], KEYS[10], KEYS[11], now_s)
local slots = tonumber(redis.call('HGET', KEYS[11], model)) or 0

-- DrainRate.rate / slot_rate
local slot_rate = tonumber(ARGV[14])
if samples > 0 then slot_rate = per_slot end
local rate = math.max(slot_rate * math.max(slots, 1), 1e-3)
local avg_cost = cost
if model_jobs > 0 then avg_cost = model_tokens / model_jobs end

local function over(max_jobs, max_tokens, jobs, tokens)
  local excess = 0
  if max_jobs >= 0 and jobs + 1 > max_jobs then excess = (jobs + 1 - max_jobs) * avg_cost end
  if max_tokens >= 0 and tokens + cost > max_tokens then
    excess = math.max(excess, tokens + cost - max_tokens)
  end
  return excess > 0
end

local wait = ahead_tokens / rate
local service = cost / math.max(slot_rate, 1e-3)
if over(tonumber(ARGV[10]), tonumber(ARGV[11]), model_jobs, model_tokens)
    or over(tonumber(ARGV[12]), tonumber(ARGV[13]), class_jobs, class_tokens)
    or (samples > 0 and wait + service > deadline - now) then
  return { 0, model_jobs, model_tokens, class_jobs, class_tokens, ahead_jobs, ahead_tokens, num(per_slot),
    samples, slots }
end

redis.call('HSET', KEYS[1], 'state', 'queued', 'seq', 1, unpack(ARGV, 17))
fq_push(KEYS[12 + ci], KEYS[4], KEYS[3], tenant, id, cost, false)
redis.call('ZADD', KEYS[6], deadline, id)
redis.call('SADD', KEYS[7], model)
if idem_ttl > 0 then
  redis.call('SET', KEYS[5], id .. ' ' .. num(now + idem_ttl), 'PX', math.ceil(idem_ttl * 1000))
end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[16], '0-1', 't', 'queued',
  'd', '{"position":' .. ahead_jobs .. ',"estimated_start_s":' .. num(wait) .. '}')
redis.call('ZADD', KEYS[12], 0, 'w')
return { 1, ahead_jobs, num(wait) }
