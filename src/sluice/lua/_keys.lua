-- Shared by every script (included first). Key builders mirrored from sluice/broker/redis_keys.py,
-- for the keys a script only learns from data (the tenant it pops, the job it finds expired); they
-- all start with the hash-tagged prefix of the shard the script was called on (redis_shards.py),
-- so they live in the same cluster slot as the declared KEYS.
-- tests/broker/test_redis.py checks that these builders and redis_keys.py agree.

-- part is memoized: a script builds the same few names many times. The memo lives as long as the
-- library (redis_library.py: these files run once, when it is loaded), so it is emptied when it
-- holds PARTS_MAX names: tenants come and go without bound.
local ESCAPES, PARTS, PARTS_N, PARTS_MAX = { ['%'] = '%25', [':'] = '%3A' }, {}, 0, 4096
local function part(s)
  local p = PARTS[s]
  if p == nil then
    p = string.gsub(s, '[%%:]', ESCAPES)
    if PARTS_N >= PARTS_MAX then PARTS, PARTS_N = {}, 0 end
    PARTS[s], PARTS_N = p, PARTS_N + 1
  end
  return p
end

local function job_key(P, id) return P .. 'job:' .. id end
local function out_key(P, id) return P .. 'out:' .. id end
local function tq_key(P, model, cls, tenant)
  return P .. 'tq:' .. part(model) .. ':' .. part(cls) .. ':' .. part(tenant)
end
local function sched_key(P, model, cls) return P .. 'sched:' .. part(model) .. ':' .. part(cls) end
local function state_key(P, model) return P .. 'qs:' .. part(model) end
local function marker_key(P, model) return P .. 'marker:' .. part(model) end
local function tenant_key(P, tenant) return P .. 'tenant:' .. part(tenant) end
local function capped_key(P) return P .. 'capped' end
local function callbacks_key(P) return P .. 'callbacks' end
local function callbacks_marker_key(P) return P .. 'cbmarker' end

-- Numbers handed back to Python as strings: a Lua number in a reply is truncated to an integer, and
-- tostring() keeps only 14 digits.
local function num(x) return string.format('%.17g', x) end
