-- Shared: start-time fair queuing between the tenants of one class, a line-by-line port of
-- sluice.core.scheduler.FairQueue: a job takes cost / weight of virtual time.
--
-- state hash (see _state.lua), per class c: v:c vtime, s:c heap sequence, j:c jobs, k:c tokens;
--             per tenant t:c:<tenant> its tag (the start tag of its head job while it has work) and
--             f:c:<tenant> the finish tag of its last dispatched job. A tenant FairQueue forgets
--             has neither field. Per tenant list, w:<tq key> the cost of the jobs in it (the
--             tenant's ``tokens`` in FairQueue), absent for none; hd:<tq key> what admit.lua last
--             read of the list's head job, '<cost> <weight> <jobs>:<tag>' (head_of there), which
--             holds while the list has <jobs> jobs and its tenant's tag field is <tag> as text.
-- sched zset: FairQueue's heap. Member '<15-digit seq><tenant>', score the tag it was pushed with:
--             Redis orders equal scores by member, and the fixed-width seq makes that (tag, seq).
--             As in the heap, an entry whose tag is no longer its tenant's, or whose tenant has no
--             work left, is stale and dropped only when it reaches the top.
-- tq list:    the tenant's job ids, head first.

-- The state field of the cost queued in a tenant's list tq (memoized as the names of _state.lua).
local WORK_NAMES = new_memo(PARTS_MAX)
local function f_work(tq) return WORK_NAMES.t[tq] or memo_put(WORK_NAMES, tq, 'w:' .. tq) end

-- The state field of what admit.lua last read of the head job of list tq (memoized as f_work).
-- Every change of a list's head changes its length or its tenant's tag, so the field goes stale
-- by itself; the changes that keep both (a job handed back to the front at the same tag, a job
-- removed and another queued in between) drop it here as well.
local HEAD_NAMES = new_memo(PARTS_MAX)
local function f_head(tq) return HEAD_NAMES.t[tq] or memo_put(HEAD_NAMES, tq, 'hd:' .. tq) end

-- Adds cost to the cost queued in list tq (a field only while it is above zero).
local function fq_add_work(st, tq, cost)
  local w = st_num(st, f_work(tq), 0) + cost
  if w > 0 then st_set(st, f_work(tq), w) else st_set(st, f_work(tq), false) end
end

-- FairQueue._schedule: a new heap entry for the tenant at its current tag.
local function fq_schedule(st, c, sched, tenant, tag)
  local seq = st_num(st, f_seq(c), 0) + 1
  st_set(st, f_seq(c), seq)
  st_set(st, f_tag(c, tenant), tag)
  rcall('ZADD', sched, tag, string.format('%015d', seq) .. tenant)
end

-- FairQueue.push. front=true is for a job handed back (lease lost): next for its tenant, at the
-- current virtual time rather than behind the tenant's later work.
local function fq_push(st, c, sched, tq, tenant, id, cost, front)
  local vtime = st_num(st, f_vtime(c), 0)
  if front then
    st_set(st, f_head(tq), false) -- a new head, maybe at the same tag
    local was_idle = rcall('LPUSH', tq, id) == 1
    if was_idle then
      fq_schedule(st, c, sched, tenant, vtime)
    else
      fq_schedule(st, c, sched, tenant, math.min(st_num(st, f_tag(c, tenant), vtime), vtime))
    end
  elseif rcall('RPUSH', tq, id) == 1 then
    -- a tenant FairQueue does not know starts with finish = vtime
    fq_schedule(st, c, sched, tenant, math.max(vtime, st_num(st, f_finish(c, tenant), vtime)))
  end
  fq_add_work(st, tq, cost)
  st_set(st, f_jobs(c), st_num(st, f_jobs(c), 0) + 1)
  st_set(st, f_tokens(c), st_num(st, f_tokens(c), 0) + cost)
end

-- FairQueue._take_head / peek: the first valid heap entry of a tenant not in `blocked` (a set:
-- tenant -> true), dropping the stale entries met on the way; the entries of blocked tenants stay.
-- Returns nil or {member, tag, tenant, tq, head job id, the tag's text as the heap gave it}.
local function fq_peek(P, st, model, c, sched, blocked)
  local kept = 0 -- entries of blocked tenants, left in place at the front
  while true do
    local top = rcall('ZRANGE', sched, kept, kept + 15, 'WITHSCORES')
    if #top == 0 then return nil end
    for i = 1, #top, 2 do
      local member, tag = top[i], top[i + 1] * 1
      local tenant = string.sub(member, 16)
      local tq = tq_key(P, model, c, tenant)
      local id = false
      if st_num(st, f_tag(c, tenant), nil) == tag then id = rcall('LINDEX', tq, '0') end
      if not id then
        rcall('ZREM', sched, member) -- stale: the tenant was re-tagged or emptied
      elseif blocked[tenant] then
        kept = kept + 1
      else
        return { member, tag, tenant, tq, id, top[i + 1] }
      end
    end
  end
end

-- FairQueue.has_eligible: a tenant not in `blocked` has work in this class. Reads only.
local function fq_has_eligible(P, st, model, c, sched, blocked, jobs)
  if jobs <= 0 then return false end
  if next(blocked) == nil then return true end
  local members = rcall('ZRANGE', sched, '0', '-1', 'WITHSCORES')
  for i = 1, #members, 2 do
    local tenant = string.sub(members[i], 16)
    if not blocked[tenant] and st_num(st, f_tag(c, tenant), nil) == members[i + 1] * 1
        and rcall('LLEN', tq_key(P, model, c, tenant)) > 0 then
      return true
    end
  end
  return false
end

-- FairQueue.pop of the head found by fq_peek; cost and weight are the head job's.
local function fq_pop(st, c, sched, head, cost, weight)
  local member, tag, tenant, tq = head[1], head[2], head[3], head[4]
  rcall('ZREM', sched, member)
  rcall('LPOP', tq)
  fq_add_work(st, tq, -cost)
  st_set(st, f_vtime(c), head[6] or tag) -- the heap's text of it: not formatted again
  local finish = tag + cost / weight
  st_set(st, f_finish(c, tenant), finish)
  if rcall('LLEN', tq) > 0 then
    fq_schedule(st, c, sched, tenant, finish)
  else
    st_set(st, f_head(tq), false)
    if finish <= tag then
      -- nothing to remember: max(vtime, finish) is vtime anyway
      st_set(st, f_tag(c, tenant), false)
      st_set(st, f_finish(c, tenant), false)
    end
  end
  st_set(st, f_jobs(c), st_num(st, f_jobs(c), 0) - 1)
  st_set(st, f_tokens(c), st_num(st, f_tokens(c), 0) - cost)
end

-- FairQueue.remove. Returns true when the job was queued there.
local function fq_remove(st, c, tq, id, cost)
  if rcall('LREM', tq, '1', id) == 0 then return false end
  st_set(st, f_head(tq), false) -- it may have been the head
  fq_add_work(st, tq, -cost)
  st_set(st, f_jobs(c), st_num(st, f_jobs(c), 0) - 1)
  st_set(st, f_tokens(c), st_num(st, f_tokens(c), 0) - cost)
  return true
end
