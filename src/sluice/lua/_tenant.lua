-- Shared: per-tenant limits, a mirror of sluice.core.ratelimit (TenantLimiter, Bucket) and of the
-- memory broker's tenant bookkeeping. One hash per tenant:
--   q jobs queued, r jobs running;
--   rpm, tpm, mq, mc: the policy (requests and tokens per minute, max queued, max concurrent),
--     a field only when set;
--   rl, rs / tl, ts: level and stamp of the requests / tokens bucket (no level yet: full; a level
--     below zero is a debt, left by a job that used more tokens than it was charged).
-- The blocked set holds the tenants at their concurrency cap, so that claim skips them.
-- A tenant with no jobs and no buckets is forgotten, policy and all, as the memory broker does.

-- Bucket.refill: the level now, and the new stamp.
local function bucket_refill(level, stamp, cap, now)
  if level == nil then return cap, now end
  return math.min(cap, level + (now - stamp) * (cap / 60.0)), now
end

-- Moves one job of a tenant between 'queued', 'running' and nothing (nil), keeping the blocked set.
local function tenant_move(P, blocked, tenant, from, to)
  local tk = tenant_key(P, tenant)
  local t = redis.call('HMGET', tk, 'q', 'r', 'mc', 'rpm', 'tpm')
  local q, r, mc = tonumber(t[1]) or 0, tonumber(t[2]) or 0, tonumber(t[3])
  if from == 'queued' then q = q - 1 elseif from == 'running' then r = r - 1 end
  if to == 'queued' then q = q + 1 elseif to == 'running' then r = r + 1 end
  if q <= 0 and r <= 0 and not t[4] and not t[5] then
    redis.call('DEL', tk)
    if mc then redis.call('SREM', blocked, tenant) end
    return
  end
  redis.call('HSET', tk, 'q', q, 'r', r)
  if mc then
    if r >= mc then
      redis.call('SADD', blocked, tenant)
    else
      redis.call('SREM', blocked, tenant)
    end
  end
end

-- TenantLimiter.settle: gives back the tokens a job was charged and did not use, and takes those
-- it used beyond its charge (the level may go below zero: a debt). used < 0: unknown, no change.
local function tenant_settle(P, tenant, charged, used, now)
  if used < 0 or used == charged then return end
  local tk = tenant_key(P, tenant)
  local t = redis.call('HMGET', tk, 'tpm', 'tl', 'ts')
  local cap = tonumber(t[1])
  if not cap then return end
  local level = bucket_refill(tonumber(t[2]), tonumber(t[3]), cap, now)
  if used < charged then
    level = math.min(cap, level + (charged - used))
  else
    level = level - (used - charged)
  end
  redis.call('HSET', tk, 'tl', num(level), 'ts', now)
end
