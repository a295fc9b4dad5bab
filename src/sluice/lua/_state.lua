-- Shared: a write-back view of one model's state hash (sluice.broker.redis_keys.QueueKeys.state). Every
-- redis.call costs far more than the work it does, so a script reads the fields it knows it needs
-- with one HMGET, reads any other on first use, and writes all changes back with one HSET.

-- st_open reads `fields` with one HMGET; the first `keep` of them (all when nil) go into the view,
-- and the reply comes back too: fields a script reads once, before any write, it may take from
-- the reply by position instead (each field put in the view is a table insert, and the view's
-- table grows by rehashing). A field left out is read again by st_num if asked for.
local function st_open(key, fields, keep)
  local st, got = { key = key, v = {}, dirty = {} }, {}
  if #fields > 0 then
    got = rcall('HMGET', key, unpack(fields))
    for i = 1, keep or #fields do st.v[fields[i]] = got[i] end
  end
  return st, got
end

local function st_num(st, f, default)
  local v = st.v[f]
  if v == nil then
    v = rcall('HGET', st.key, f)
    st.v[f] = v
  end
  if v then return v * 1 end
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
      if type(v) == 'number' then v = int_text(v) end
      sets[#sets + 1] = v
    else
      dels[#dels + 1] = f
    end
  end
  if #sets > 0 then rcall('HSET', st.key, unpack(sets)) end
  if #dels > 0 then rcall('HDEL', st.key, unpack(dels)) end
  st.dirty = {}
end

-- Field names; a class name is escaped so that '<class>:<tenant>' cannot be read two ways. They
-- are memoized while the library lives (a name built is a new string, ~1.5 k instructions; a
-- script builds the same few dozen each call): per class (new_memo), and in it per tenant.
local CLASS_NAMES = new_memo(PARTS_MAX)
local function class_names(c)
  local n = CLASS_NAMES.t[c]
  if n == nil then
    local p = part(c)
    n = memo_put(CLASS_NAMES, c, { j = 'j:' .. p, k = 'k:' .. p, c = 'c:' .. p, v = 'v:' .. p, s = 's:' .. p,
      tenants = new_memo(PARTS_MAX) })
  end
  return n
end
local function f_jobs(c) return class_names(c).j end
local function f_tokens(c) return class_names(c).k end
local function f_credit(c) return class_names(c).c end
local function f_vtime(c) return class_names(c).v end
local function f_seq(c) return class_names(c).s end
-- The tag and finish fields of a tenant in class c: { tag, finish }.
local function tenant_names(c, tenant)
  local memo = class_names(c).tenants
  local n = memo.t[tenant]
  if n == nil then
    local p = part(c)
    n = memo_put(memo, tenant, { 't:' .. p .. ':' .. tenant, 'f:' .. p .. ':' .. tenant })
  end
  return n
end
local function f_tag(c, tenant) return tenant_names(c, tenant)[1] end
local function f_finish(c, tenant) return tenant_names(c, tenant)[2] end

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
