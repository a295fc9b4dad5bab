-- Shared: per-key limits, a mirror of sluice.core.ratelimit (TenantLimiter, Bucket) and of the
-- memory broker's tenant bookkeeping (_Tenant). One hash per tenant:
--   q jobs queued, r jobs running (every model);
--   mc the tenant's concurrency cap (of the key that sent its latest job), only when set;
--   and the buckets of each of its keys, named by the key's bucket id K (TenantLimits.bucket_id,
--   '' for a caller without a key), escaped (part): rl:K, rs:K / tl:K, ts:K the level and stamp of
--   its requests / tokens bucket (no level yet: full; a level below zero is a debt, left by a job
--   that used more tokens than it was charged), tpm:K its tokens per minute (for finish). A key's
--   buckets are its own: no other key's request touches them, and a change of its limits keeps
--   their levels (TenantLimiter.update).
-- A job's record names the buckets it was charged to in its field 'kb' (written by admit.lua).
-- The blocked set holds the tenants at their concurrency cap, so that claim skips them; the capped
-- set those with more jobs queued and running than their cap, whose queued jobs beyond it admit
-- does not count as ahead of other tenants' (ClassScheduler.held_back).
-- A tenant with no jobs and no buckets is forgotten, cap and all, as the memory broker does.

-- The fields of the buckets of key id K in its tenant's hash (memoized as part is; the table is
-- shared: read it only).
local BUCKET_FIELDS = new_memo(PARTS_MAX)
local function bucket_fields(K)
  local B = BUCKET_FIELDS.t[K]
  if B == nil then
    local k = part(K)
    B = memo_put(BUCKET_FIELDS, K,
      { rl = 'rl:' .. k, rs = 'rs:' .. k, tpm = 'tpm:' .. k, tl = 'tl:' .. k, ts = 'ts:' .. k })
  end
  return B
end

-- The fields of a tenant's hash that are not buckets: with only these, it has none.
local TENANT_OWN_FIELDS = { q = true, r = true, mc = true }

-- The blocked and capped sets for a tenant with q jobs queued and r running under its cap mc (nil:
-- none); had_cap: it had one, so it may be in them still.
local function tenant_sets(P, blocked, tenant, q, r, mc, had_cap)
  if mc then
    if r >= mc then rcall('SADD', blocked, tenant) else rcall('SREM', blocked, tenant) end
    if q + r > mc then
      rcall('SADD', capped_key(P), tenant)
    else
      rcall('SREM', capped_key(P), tenant)
    end
  elseif had_cap then
    rcall('SREM', blocked, tenant)
    rcall('SREM', capped_key(P), tenant)
  end
end

-- Bucket.refill: the level now, and the new stamp.
local function bucket_refill(level, stamp, cap, now)
  if level == nil then return cap, now end
  return math.min(cap, level + (now - stamp) * (cap / 60.0)), now
end

-- Moves one job of a tenant between 'queued', 'running' and nothing (nil), keeping the blocked
-- and capped sets. Returns true when a running job's move took the tenant from its concurrency
-- cap (the blocked set, which claim skips) to under it with jobs still queued: a slot freed for
-- jobs that no claim could take before (the caller wakes the model's claimers).
local function tenant_move(P, blocked, tenant, from, to)
  local tk = tenant_key(P, tenant)
  local t = rcall('HMGET', tk, 'q', 'r', 'mc')
  local q, r, mc = (t[1] or 0) * 1, (t[2] or 0) * 1, tonum(t[3])
  if from == 'queued' then q = q - 1 elseif from == 'running' then r = r - 1 end
  if to == 'queued' then q = q + 1 elseif to == 'running' then r = r + 1 end
  if q <= 0 and r <= 0 then
    local own = 0 -- of the hash's fields, those that are not buckets
    for _, v in ipairs(t) do if v then own = own + 1 end end
    if rcall('HLEN', tk) <= own then
      rcall('DEL', tk)
      tenant_sets(P, blocked, tenant, 0, 0, nil, mc ~= nil)
      return false
    end
  end
  rcall('HSET', tk, 'q', int_text(q), 'r', int_text(r))
  tenant_sets(P, blocked, tenant, q, r, mc, false)
  return from == 'running' and mc ~= nil and r < mc and r + 1 >= mc and q > 0
end

-- TenantLimiter.settle: gives back the tokens a job was charged and did not use, and takes those
-- it used beyond its charge (the level may go below zero: a debt). used < 0: unknown, no change.
-- bucket: the id of the key whose buckets the job was charged to (its record's 'kb'); nil: none.
local function tenant_settle(P, tenant, bucket, charged, used, now)
  if bucket == nil or used < 0 or used == charged then return end
  local tk, B = tenant_key(P, tenant), bucket_fields(bucket)
  local t = rcall('HMGET', tk, B.tpm, B.tl, B.ts)
  local cap = tonum(t[1])
  if not cap then return end
  local level = bucket_refill(tonum(t[2]), tonum(t[3]), cap, now)
  if used < charged then
    level = math.min(cap, level + (charged - used))
  else
    level = level - (used - charged)
  end
  rcall('HSET', tk, B.tl, num(level), B.ts, now)
end
