-- position: how many queued jobs would be dispatched before this one (read only), a mirror of
-- ClassScheduler.position: every job of the classes above, then FairQueue.position inside its class
-- (the tenant's own jobs ahead, and each other tenant's jobs whose start tags come before its own).
-- O(jobs ahead in the class): meant for a status query, not for a hot path.
--
-- KEYS[1] job hash
-- ARGV[1] queue prefix   ARGV[2] job id   ARGV[3 ..] class names, highest first
-- Returns the position, or -1 when the job is not queued.
-- Builds state, sched, tenant-list and job keys from the prefix (same slot as KEYS).

-- @include _keys.lua
-- @include _state.lua

local job_k = KEYS[1]
local P, id = ARGV[1], ARGV[2]
local CLASSES_AT = 3 -- ARGV[CLASSES_AT ..]: class names, highest first

local f = rcall('HMGET', job_k, 'state', 'model', 'priority', 'tenant')
if f[1] ~= 'queued' then return -1 end
local model, cls, tenant = f[2], f[3], f[4]
local st = st_open(state_key(P, model), {})

local above = 0
for i = CLASSES_AT, #ARGV do
  if ARGV[i] == cls then break end
  above = above + st_num(st, f_jobs(ARGV[i]), 0)
end

-- a job's virtual service time, as in FairQueue: cost / weight
local function cost_of(jid)
  local c = rcall('HMGET', job_key(P, jid), 'cost', 'weight')
  return c[1] / (c[2] or 1.0) -- arithmetic reads both texts as numbers (_keys.lua, tonum)
end

local tq, sched = tq_key(P, model, cls, tenant), sched_key(P, model, cls)
local idx = rcall('LPOS', tq, id)
if not idx then return -1 end
local before = 0 -- summed first, then added to the tag, as Python's sum() does
if idx > 0 then
  for _, jid in ipairs(rcall('LRANGE', tq, 0, idx - 1)) do
    before = before + cost_of(jid)
  end
end
local own = st_num(st, f_tag(cls, tenant), 0) + before

local ahead, seen = idx, { [tenant] = true }
-- Heap entries in tag order: a tenant whose tag is below ours has a live entry below ours.
for _, m in ipairs(rcall('ZRANGEBYSCORE', sched, '-inf', '(' .. num(own))) do
  local other = string.sub(m, 16)
  if not seen[other] then
    seen[other] = true
    local tag = st_num(st, f_tag(cls, other), nil)
    local otq = tq_key(P, model, cls, other)
    local n, start = rcall('LLEN', otq), 0
    while tag and start < n and tag < own do
      for _, jid in ipairs(rcall('LRANGE', otq, start, start + 99)) do
        if tag >= own then break end
        ahead = ahead + 1
        tag = tag + cost_of(jid)
      end
      start = start + 100
    end
  end
end
return above + ahead
