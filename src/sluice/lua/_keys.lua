-- Shared by every script (included first). Key builders mirrored from sluice/broker/redis_keys.py,
-- for the keys a script only learns from data (the tenant it pops, the job it finds expired); they
-- all start with the hash-tagged prefix of the shard the script was called on (redis_shards.py),
-- so they live in the same cluster slot as the declared KEYS.
-- tests/broker/test_redis.py checks that these builders and redis_keys.py agree.

-- redis.call, kept where the scripts reach it as an upvalue: the global `redis` is looked up
-- through the globals' __index in a function, ~300 instructions at each of the dozens of calls a
-- script makes. There is no redis.call while the library loads: each function sets it as it
-- starts (redis_library.build_library), before anything runs.
local rcall = nil

-- A memo of what a script builds the same many times (names, parsed settings). It lives as long
-- as the library (redis_library.py: these files run once, when it is loaded), so it holds at most
-- `max` entries and then starts again: tenants and texts come and go without bound, and a rebuild
-- costs only what every call paid before. Read m.t[key]; memo_put stores a value and returns it.
local function new_memo(max) return { t = {}, n = 0, max = max } end
local function memo_put(m, key, value)
  if m.n >= m.max then m.t, m.n = {}, 0 end
  m.t[key], m.n = value, m.n + 1
  return value
end

-- The size of each memo of names: part's, and those of the state's and the tenants' fields.
local PARTS_MAX = 4096
local ESCAPES, PARTS = { ['%'] = '%25', [':'] = '%3A' }, new_memo(PARTS_MAX)
local function part(s)
  return PARTS.t[s] or memo_put(PARTS, s, (string.gsub(s, '[%%:]', ESCAPES)))
end

-- A script's settings: what every call passes the same (the gateway's configuration and the core's
-- constants) comes as one argument, its values joined by byte 31 ('%' and byte 31 in a value as
-- %25 and %1F: redis_codec.settings_text), parsed once per text by the script's `parse` (the
-- values, as strings, to what the script uses: numbers, lists, field names) and kept while the
-- library lives. An argument costs Redis about 1.1 k instructions and a tonumber of 17 digits
-- about 3 k: admit's 30 fixed values were a tenth of its cost. The memo holds SETTINGS_MAX texts
-- per script (new_memo). What parse returns is shared by every later call with that text: a call
-- may keep a memo of its own in it, and must change nothing else.
local SETTINGS, SETTINGS_MAX = {}, 1024 -- script -> its memo of parsed texts
local function unescape_hex(hex) return string.char(tonumber(hex, 16)) end
local function settings_of(script, text, parse)
  local memo = SETTINGS[script]
  if memo == nil then
    memo = new_memo(SETTINGS_MAX)
    SETTINGS[script] = memo
  end
  local s = memo.t[text]
  if s == nil then
    local values = {}
    for v in string.gmatch(text .. '\31', '([^\31]*)\31') do
      if string.find(v, '%', 1, true) then v = string.gsub(v, '%%(%x%x)', unescape_hex) end
      values[#values + 1] = v
    end
    s = memo_put(memo, text, parse(values))
  end
  return s
end

-- A member of the deadline, active and results zsets that no job id can be, at score +inf (so that
-- no ZRANGEBYSCORE up to now ever returns it), added with each job: longer than
-- zset-max-listpack-value (64 bytes by default), it keeps the zset a skiplist. As a listpack (under
-- 128 members) every ZADD walked it from the start, parsing each member's score text: 30-40 k
-- instructions a call at ~100 members, against a few thousand for a skiplist's insert. Mirrored
-- as redis_keys.SKIPLIST_MEMBER.
local SKIPLIST_MEMBER = '~ a member over zset-max-listpack-value: this zset stays a skiplist (lua/_keys.lua)'

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
local function models_key(P) return P .. 'models' end
local function callbacks_key(P) return P .. 'callbacks' end
local function callbacks_marker_key(P) return P .. 'cbmarker' end

-- Numbers to Redis, one rule for every script: a text the script already has (an argument, a
-- reply) goes as that text; an integer as int_text; any other number as the number, which Redis
-- formats itself (%.17g in Redis 7.0; later ones may write the shortest text that reads back:
-- the same number either way) for about half of what num, a Lua string.format, costs. num is for
-- a number inside a text (a reply's, a record's JSON). Redis's formatting is about 2 k
-- instructions a number and a script passes dozens: int_text memoizes the integers
-- 0 .. INT_TEXT_MAX - 1, which most are (counts, sequence numbers), and passes anything else on.
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

-- A number this broker wrote as text, read with one parse; nil or false (a field not there) reads
-- as nil. Lua 5.1's tonumber parses a text twice (lua_isnumber, then lua_tonumber): in a Redis
-- function ~3.1 k instructions for a 17-digit text (a time, a rate), against ~1.3 k for `x * 1`,
-- which coerces it once and is x exactly. The scripts write `x * 1` where x is always there, `(x or 0) * 1`
-- for a default, and nothing where arithmetic coerces x anyway (`f.seq + 1`; a comparison does
-- not). That holds for the scripts' own arguments too (a time, a TTL, a count: Python's numbers).
-- Unlike tonumber a text that is no number raises an error, so tonumber stays where a text may be
-- empty or no number (a limit not given) and in a settings parse (once per text anyway).
local function tonum(x) if x then return x * 1 end end

-- Numbers handed back to Python as strings: a Lua number in a reply is truncated to an integer, and
-- tostring() keeps only 14 digits.
local function num(x) return string.format('%.17g', x) end
-- num(x), and for a small integer (a count, a limit) its memoized text, the same characters.
local function num_text(x)
  if x % 1 == 0 and x >= 0 and x < INT_TEXT_MAX and 1 / x > 0 then return int_text(x) end
  return num(x)
end
