-- Shared: a write-back view of one model's state hash (sluice.broker.redis_keys.QueueKeys.state). Every
-- redis.call costs far more than the work it does, so a script reads the fields it knows it needs
-- with one HMGET, reads any other on first use, and writes all changes back with one HSET.

local function st_open(key, fields)
  local st = { key = key, v = {}, dirty = {} }
  if #fields > 0 then
    local got = redis.call('HMGET', key, unpack(fields))
    for i, f in ipairs(fields) do st.v[f] = got[i] end
  end
  return st
end

local function st_num(st, f, default)
  local v = st.v[f]
  if v == nil then
    v = redis.call('HGET', st.key, f)
    st.v[f] = v
  end
  if v then return tonumber(v) end
  return default
end

local function st_set(st, f, value)
  st.v[f] = value
  st.dirty[f] = true
end

local function st_flush(st)
  local sets, dels = {}, {}
  for f in pairs(st.dirty) do
    local v = st.v[f]
    if v then
      sets[#sets + 1] = f
      sets[#sets + 1] = v
    else
      dels[#dels + 1] = f
    end
  end
  if #sets > 0 then redis.call('HSET', st.key, unpack(sets)) end
  if #dels > 0 then redis.call('HDEL', st.key, unpack(dels)) end
  st.dirty = {}
end

-- Field names; a class name is escaped so that '<class>:<tenant>' cannot be read two ways.
local function f_jobs(c) return 'j:' .. part(c) end
local function f_tokens(c) return 'k:' .. part(c) end
local function f_credit(c) return 'c:' .. part(c) end
local function f_vtime(c) return 'v:' .. part(c) end
local function f_seq(c) return 's:' .. part(c) end
local function f_tag(c, tenant) return 't:' .. part(c) .. ':' .. tenant end
local function f_finish(c, tenant) return 'f:' .. part(c) .. ':' .. tenant end

-- The jobs, tokens and credit fields of every class, for one HMGET.
local function class_fields(classes)
  local fields = {}
  for _, c in ipairs(classes) do
    fields[#fields + 1] = f_jobs(c)
    fields[#fields + 1] = f_tokens(c)
    fields[#fields + 1] = f_credit(c)
  end
  return fields
end
