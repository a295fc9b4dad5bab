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

-- A script's settings: what every call passes the same (the gateway's configuration and the core's
-- constants) comes as one argument, its values joined by byte 31 ('%' and byte 31 in a value as
-- %25 and %1F: redis_codec.settings_text), parsed once per text by the script's `parse` (the
-- values, as strings, to what the script uses: numbers, lists, field names) and kept while the
-- library lives. An argument costs Redis about 1.1 k instructions and a tonumber of 17 digits
-- about 3 k: admit's 30 fixed values were a tenth of its cost. The memo holds SETTINGS_MAX texts
-- per script, then starts again (a parse costs what every call paid before). What parse returns
-- is shared by every later call with that text: a call may keep a memo of its own in it, and
-- must change nothing else.
local SETTINGS, SETTINGS_N, SETTINGS_MAX = {}, {}, 1024
local function unescape_hex(hex) return string.char(tonumber(hex, 16)) end
local function settings_of(script, text, parse)
  local memo = SETTINGS[script]
  if memo == nil then
    memo = {}
    SETTINGS[script], SETTINGS_N[script] = memo, 0
  end
  local s = memo[text]
  if s == nil then
    local values = {}
    for v in string.gmatch(text .. '\31', '([^\31]*)\31') do
      if string.find(v, '%', 1, true) then v = string.gsub(v, '%%(%x%x)', unescape_hex) end
      values[#values + 1] = v
    end
    s = parse(values)
    if SETTINGS_N[script] >= SETTINGS_MAX then
      memo = {}
      SETTINGS[script], SETTINGS_N[script] = memo, 0
    end
    memo[text], SETTINGS_N[script] = s, SETTINGS_N[script] + 1
  end
  return s
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

-- The text Redis makes of a number passed to redis.call (%.17g: about 2 k instructions each, a
-- script passes dozens), memoized for the integers 0 .. INT_TEXT_MAX - 1, which most are (counts,
-- sequence numbers): the same text, made once. Anything else is passed on as the number.
local INT_TEXT, INT_TEXT_MAX = {}, 4096
local function int_text(x)
  local t = INT_TEXT[x]
  if t then return t end
  if x >= 0 and x < INT_TEXT_MAX and x % 1 == 0 and 1 / x > 0 then -- not -0, which prints as '-0'
    t = string.format('%d', x)
    INT_TEXT[x] = t
    return t
  end
  return x
end

-- Numbers handed back to Python as strings: a Lua number in a reply is truncated to an integer, and
-- tostring() keeps only 14 digits.
local function num(x) return string.format('%.17g', x) end
