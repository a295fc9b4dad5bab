-- Shared: the job record, its event stream and its terminal states.
-- A script that includes this fills the context table J first (every field it uses: J outlives
-- the call, as the library's shared files run once, when it is loaded):
--   J.P prefix, J.now (number), J.now_s (the caller's exact text of now), J.ttl result TTL in seconds,
--   J.maxlen events kept per stream, J.results zset, J.running hash, J.blocked set (and it
--   includes _tenant.lua before this file). Jobs with a callback_url join the callbacks list when
--   they end (callbacks.lua).

local J = {}

-- The text of a settled record's TTL in milliseconds (the result TTL and a minute), made once
-- per TTL, instead of a number Redis formats at every settle (_keys.lua, int_text).
local TTL_MS = new_memo(64)
local function ttl_ms_text(ttl)
  return TTL_MS.t[ttl] or memo_put(TTL_MS, ttl, string.format('%d', math.ceil(ttl * 1000) + 60000))
end

-- The whole record as a table by field name (empty when the job is unknown). One HGETALL costs
-- about what a HMGET of the fields a script needs would, and lets a script answer with the record
-- it changed without reading it again.
local function job_read(jk)
  local flat = rcall('HGETALL', jk)
  local f = {}
  for i = 1, #flat, 2 do f[flat[i]] = flat[i + 1] end
  return f
end

-- Records field, value pairs both in the hash and in f.
local function job_set(jk, f, pairs_)
  rcall('HSET', jk, unpack(pairs_))
  for i = 1, #pairs_, 2 do f[pairs_[i]] = pairs_[i + 1] end
end

-- The reply {1, field, value, ...} for Python's decode_job.
local function job_reply(f)
  local out = { 1 }
  for k, v in pairs(f) do
    out[#out + 1] = k
    out[#out + 1] = v
  end
  return out
end

-- Appends event number `seq` (the caller stores seq in the record); ids 0-1, 0-2, ... make the
-- sequence number the SSE event id.
local function emit(ok, seq, etype, data)
  rcall('XADD', ok, 'MAXLEN', '~', J.maxlen, '0-' .. int_text(seq), 't', etype, 'd', data)
end

-- Puts a job in a terminal state, with `changes` (field, value, ...) recorded too, publishes its
-- terminal event and starts its result TTL. f is the record as job_read returned it. The terminal
-- event's data is empty: readers fill in the job's view from the record (sluice.views.job_view),
-- which then is final, so that the view is built in one place. The results zset drives removal on
-- the caller's clock; the Redis TTL (a minute later) only catches records no upkeep ever reaped.
-- An expired job was admitted and then ran past its deadline: it counts as a broken promise, in
-- field 'bp' of its model's state hash (redis_keys.BROKEN_PROMISES_FIELD).
local function settle(id, f, state, changes)
  local jk, ok = job_key(J.P, id), out_key(J.P, id)
  if f.state == 'running' then
    rcall('HINCRBY', J.running, f.model, '-1')
  end
  if state == 'expired' then rcall('HINCRBY', state_key(J.P, f.model), 'bp', '1') end
  if tenant_move(J.P, J.blocked, f.tenant, f.state, nil) then
    -- Its end freed a slot of a tenant at its cap with jobs queued, which no claim could take:
    -- the claimers wake, who would wait out their bound otherwise (MemoryBroker._move wakes every
    -- claim). Those of every model of this shard: the cap spans the tenant's models, and its held
    -- jobs may be in any of them (which ones, no key says). A claimer of a model with none of
    -- them finds nothing and waits again; this is only the end of a capped tenant's job.
    rcall('ZADD', marker_key(J.P, f.model), '0', 'w')
    for _, model in ipairs(rcall('SMEMBERS', models_key(J.P))) do
      if model ~= f.model then rcall('ZADD', marker_key(J.P, model), '0', 'w') end
    end
  end
  local seq = f.seq + 1
  local args = { 'state', state, 'finished_at', J.now_s, 'seq', int_text(seq) }
  for i = 1, #changes do args[#args + 1] = changes[i] end
  job_set(jk, f, args)
  rcall('ZADD', J.results, J.now + J.ttl, id, 'inf', SKIPLIST_MEMBER)
  local etype = 'error'
  if state == 'succeeded' then etype = 'done' end
  emit(ok, seq, etype, '')
  if f.callback_url then
    rcall('RPUSH', callbacks_key(J.P), id)
    rcall('ZADD', callbacks_marker_key(J.P), '0', 'w')
  end
  local ms = ttl_ms_text(J.ttl)
  rcall('PEXPIRE', jk, ms)
  rcall('PEXPIRE', ok, ms)
end
