-- Shared: start-time fair queuing between the tenants of one class, a mirror of
-- sluice.core.scheduler.FairQueue (weight 1: a job's cost is its virtual service time).
--
-- fq hash:    vtime, seq, jobs, tokens, f:<tenant> finish tag, m:<tenant> the tenant's sched member
-- sched zset: '<15-digit seq><tenant>' -> start tag of the tenant's head job. FairQueue's heap orders
--             by (tag, seq); the zset orders equal scores by member, and the fixed-width seq makes
--             that the same order.
-- tq list:    the tenant's job ids, head first.
--
-- Like FairQueue, removing a job never re-tags its tenant: a member whose list went empty stays
-- until the head is looked for, and is dropped then.

local function fq_num(fq, field, default)
  local v = redis.call('HGET', fq, field)
  if v then return tonumber(v) end
  return default
end

-- Gives a tenant the place (tag, next seq). A tenant already placed at the same tag keeps its older
-- place, as FairQueue's older heap entry wins over the new one with the same tag.
local function fq_place(fq, sched, tenant, tag)
  local old = redis.call('HGET', fq, 'm:' .. tenant)
  if old then
    local score = redis.call('ZSCORE', sched, old)
    if score and tonumber(score) == tag then return end
    redis.call('ZREM', sched, old)
  end
  local member = string.format('%015d', redis.call('HINCRBY', fq, 'seq', 1)) .. tenant
  redis.call('ZADD', sched, tag, member)
  redis.call('HSET', fq, 'm:' .. tenant, member)
end

-- FairQueue.push. front=true is for a job handed back (lease lost): next for its tenant, at the
-- current virtual time rather than behind the tenant's later work.
local function fq_push(fq, sched, tq, tenant, id, cost, front)
  local vtime = fq_num(fq, 'vtime', 0)
  local was_idle = redis.call('LLEN', tq) == 0
  if front then
    redis.call('LPUSH', tq, id)
    if was_idle then
      fq_place(fq, sched, tenant, vtime)
    else
      local score = redis.call('ZSCORE', sched, redis.call('HGET', fq, 'm:' .. tenant))
      fq_place(fq, sched, tenant, math.min(tonumber(score), vtime))
    end
  else
    redis.call('RPUSH', tq, id)
    if was_idle then
      fq_place(fq, sched, tenant, math.max(vtime, fq_num(fq, 'f:' .. tenant, vtime)))
    end
  end
  redis.call('HINCRBY', fq, 'jobs', 1)
  redis.call('HINCRBY', fq, 'tokens', cost)
end

-- FairQueue.peek: the head tenant and its head job, dropping members whose list went empty.
-- Returns nil or {member, tag, tenant, tq, id}.
local function fq_peek(P, fq, sched, model, cls)
  while true do
    local head = redis.call('ZRANGE', sched, 0, 0, 'WITHSCORES')
    if #head == 0 then return nil end
    local tenant = string.sub(head[1], 16)
    local tq = tq_key(P, model, cls, tenant)
    local id = redis.call('LINDEX', tq, 0)
    if id then
      return { head[1], tonumber(head[2]), tenant, tq, id }
    end
    redis.call('ZREM', sched, head[1])
    redis.call('HDEL', fq, 'm:' .. tenant)
  end
end

-- FairQueue.pop of the head found by fq_peek; cost is the head job's cost.
local function fq_pop(fq, sched, head, cost)
  local member, tag, tenant, tq = head[1], head[2], head[3], head[4]
  redis.call('ZREM', sched, member)
  redis.call('HDEL', fq, 'm:' .. tenant)
  redis.call('LPOP', tq)
  redis.call('HSET', fq, 'vtime', tag)
  local finish = tag + cost
  if redis.call('LLEN', tq) > 0 then
    redis.call('HSET', fq, 'f:' .. tenant, finish)
    fq_place(fq, sched, tenant, finish)
  elseif finish <= tag then
    redis.call('HDEL', fq, 'f:' .. tenant) -- nothing to remember: max(vtime, finish) is vtime anyway
  else
    redis.call('HSET', fq, 'f:' .. tenant, finish)
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
