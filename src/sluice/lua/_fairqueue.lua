-- Shared: start-time fair queuing between the tenants of one class, a line-by-line port of
-- sluice.core.scheduler.FairQueue: a job takes cost / weight of virtual time.
--
-- fq hash:    vtime, seq, jobs, tokens; per tenant t:<tenant> its tag (the start tag of its head job
--             while it has work) and f:<tenant> the finish tag of its last dispatched job. A tenant
--             FairQueue forgets has neither field.
-- sched zset: FairQueue's heap. Member '<15-digit seq><tenant>', score the tag it was pushed with:
--             Redis orders equal scores by member, and the fixed-width seq makes that (tag, seq).
--             As in the heap, an entry whose tag is no longer its tenant's, or whose tenant has no
--             work left, is stale and dropped only when it reaches the top.
-- tq list:    the tenant's job ids, head first.

local function fq_num(fq, field, default)
  local v = redis.call('HGET', fq, field)
  if v then return tonumber(v) end
  return default
end

-- FairQueue._schedule: a new heap entry for the tenant at its current tag.
local function fq_schedule(fq, sched, tenant, tag)
  redis.call('HSET', fq, 't:' .. tenant, tag)
  redis.call('ZADD', sched, tag, string.format('%015d', redis.call('HINCRBY', fq, 'seq', 1)) .. tenant)
end

-- FairQueue.push. front=true is for a job handed back (lease lost): next for its tenant, at the
-- current virtual time rather than behind the tenant's later work.
local function fq_push(fq, sched, tq, tenant, id, cost, front)
  local vtime = fq_num(fq, 'vtime', 0)
  local was_idle = redis.call('LLEN', tq) == 0
  if front then
    redis.call('LPUSH', tq, id)
    if was_idle then
      fq_schedule(fq, sched, tenant, vtime)
    else
      fq_schedule(fq, sched, tenant, math.min(fq_num(fq, 't:' .. tenant, vtime), vtime))
    end
  else
    redis.call('RPUSH', tq, id)
    if was_idle then
      -- a tenant FairQueue does not know starts with finish = vtime
      fq_schedule(fq, sched, tenant, math.max(vtime, fq_num(fq, 'f:' .. tenant, vtime)))
    end
  end
  redis.call('HINCRBY', fq, 'jobs', 1)
  redis.call('HINCRBY', fq, 'tokens', cost)
end

-- FairQueue._head / peek: the first valid heap entry, dropping stale ones on the way.
-- Returns nil or {member, tag, tenant, tq, head job id}.
local function fq_peek(P, fq, sched, model, cls)
  while true do
    local top = redis.call('ZRANGE', sched, 0, 0, 'WITHSCORES')
    if #top == 0 then return nil end
    local tag, tenant = tonumber(top[2]), string.sub(top[1], 16)
    local tq = tq_key(P, model, cls, tenant)
    if fq_num(fq, 't:' .. tenant, nil) == tag then
      local id = redis.call('LINDEX', tq, 0)
      if id then return { top[1], tag, tenant, tq, id } end
    end
    redis.call('ZREM', sched, top[1])
  end
end

-- FairQueue.pop of the head found by fq_peek; cost and weight are the head job's.
local function fq_pop(fq, sched, head, cost, weight)
  local member, tag, tenant, tq = head[1], head[2], head[3], head[4]
  redis.call('ZREM', sched, member)
  redis.call('LPOP', tq)
  redis.call('HSET', fq, 'vtime', tag)
  local finish = tag + cost / weight
  redis.call('HSET', fq, 'f:' .. tenant, finish)
  if redis.call('LLEN', tq) > 0 then
    fq_schedule(fq, sched, tenant, finish)
  elseif finish <= tag then
    redis.call('HDEL', fq, 't:' .. tenant, 'f:' .. tenant) -- nothing to remember: max(vtime, finish) is vtime
  end
  redis.call('HINCRBY', fq, 'jobs', -1)
  redis.call('HINCRBY', fq, 'tokens', -cost)
end

-- FairQueue.remove. Returns true when the job was queued there.
local function fq_remove(fq, tq, id, cost)
  if redis.call('LREM', tq, 1, id) == 0 then return false end
  redis.call('HINCRBY', fq, 'jobs', -1)
  redis.call('HINCRBY', fq, 'tokens', -cost)
  return true
end
