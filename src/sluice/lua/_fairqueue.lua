-- Shared: start-time fair queuing between the tenants of one class, a line-by-line port of
-- sluice.core.scheduler.FairQueue: a job takes cost / weight of virtual time.
--
-- state hash (see _state.lua), per class c: v:c vtime, s:c heap sequence, j:c jobs, k:c tokens;
--             per tenant t:c:<tenant> its tag (the start tag of its head job while it has work) and
--             f:c:<tenant> the finish tag of its last dispatched job. A tenant FairQueue forgets
--             has neither field.
-- sched zset: FairQueue's heap. Member '<15-digit seq><tenant>', score the tag it was pushed with:
--             Redis orders equal scores by member, and the fixed-width seq makes that (tag, seq).
--             As in the heap, an entry whose tag is no longer its tenant's, or whose tenant has no
--             work left, is stale and dropped only when it reaches the top.
-- tq list:    the tenant's job ids, head first.

-- FairQueue._schedule: a new heap entry for the tenant at its current tag.
local function fq_schedule(st, c, sched, tenant, tag)
  local seq = st_num(st, f_seq(c), 0) + 1
  st_set(st, f_seq(c), seq)
  st_set(st, f_tag(c, tenant), tag)
  redis.call('ZADD', sched, tag, string.format('%015d', seq) .. tenant)
end

-- FairQueue.push. front=true is for a job handed back (lease lost): next for its tenant, at the
-- current virtual time rather than behind the tenant's later work.
local function fq_push(st, c, sched, tq, tenant, id, cost, front)
  local vtime = st_num(st, f_vtime(c), 0)
  if front then
    local was_idle = redis.call('LPUSH', tq, id) == 1
    if was_idle then
      fq_schedule(st, c, sched, tenant, vtime)
    else
      fq_schedule(st, c, sched, tenant, math.min(st_num(st, f_tag(c, tenant), vtime), vtime))
    end
  elseif redis.call('RPUSH', tq, id) == 1 then
    -- a tenant FairQueue does not know starts with finish = vtime
    fq_schedule(st, c, sched, tenant, math.max(vtime, st_num(st, f_finish(c, tenant), vtime)))
  end
  st_set(st, f_jobs(c), st_num(st, f_jobs(c), 0) + 1)
  st_set(st, f_tokens(c), st_num(st, f_tokens(c), 0) + cost)
end

-- FairQueue._head / peek: the first valid heap entry, dropping stale ones on the way.
-- Returns nil or {member, tag, tenant, tq, head job id}.
local function fq_peek(P, st, model, c, sched)
  while true do
    local top = redis.call('ZRANGE', sched, 0, 0, 'WITHSCORES')
    if #top == 0 then return nil end
    local tag, tenant = tonumber(top[2]), string.sub(top[1], 16)
    local tq = tq_key(P, model, c, tenant)
    if st_num(st, f_tag(c, tenant), nil) == tag then
      local id = redis.call('LINDEX', tq, 0)
      if id then return { top[1], tag, tenant, tq, id } end
    end
    redis.call('ZREM', sched, top[1])
  end
end

-- FairQueue.pop of the head found by fq_peek; cost and weight are the head job's.
local function fq_pop(st, c, sched, head, cost, weight)
  local member, tag, tenant, tq = head[1], head[2], head[3], head[4]
  redis.call('ZREM', sched, member)
  redis.call('LPOP', tq)
  st_set(st, f_vtime(c), tag)
  local finish = tag + cost / weight
  st_set(st, f_finish(c, tenant), finish)
  if redis.call('LLEN', tq) > 0 then
    fq_schedule(st, c, sched, tenant, finish)
  elseif finish <= tag then
    -- nothing to remember: max(vtime, finish) is vtime anyway
    st_set(st, f_tag(c, tenant), false)
    st_set(st, f_finish(c, tenant), false)
  end
  st_set(st, f_jobs(c), st_num(st, f_jobs(c), 0) - 1)
  st_set(st, f_tokens(c), st_num(st, f_tokens(c), 0) - cost)
end

-- FairQueue.remove. Returns true when the job was queued there.
local function fq_remove(st, c, tq, id, cost)
  if redis.call('LREM', tq, 1, id) == 0 then return false end
  st_set(st, f_jobs(c), st_num(st, f_jobs(c), 0) - 1)
  st_set(st, f_tokens(c), st_num(st, f_tokens(c), 0) - cost)
  return true
end
