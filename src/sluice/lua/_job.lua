-- Shared: the job record, its event stream and its terminal states.
-- A script that includes this fills the context table J first:
--   J.P prefix, J.now (number), J.now_s (the caller's exact text of now), J.ttl result TTL in seconds,
--   J.maxlen events kept per stream, J.results zset, J.running hash.

local J = {}

-- Appends one event; ids are 0-1, 0-2, ... so that the sequence number is the SSE event id.
local function emit(jk, ok, etype, data)
  local seq = redis.call('HINCRBY', jk, 'seq', 1)
  redis.call('XADD', ok, 'MAXLEN', '~', J.maxlen, '0-' .. seq, 't', etype, 'd', data)
end

local function jstr(v)
  if v then return cjson.encode(v) end
  return 'null'
end

local function jraw(v)
  if v then return v end
  return 'null'
end

-- The public view of a job (sluice.broker.base.job_view). Numbers and JSON fields are stored as JSON
-- text by Python, so they are spliced in as they are: no float is rounded on the way.
local function view(jk)
  local f = redis.call('HMGET', jk, 'id', 'model', 'state', 'priority', 'created_at', 'started_at',
    'first_token_at', 'finished_at', 'deadline', 'attempts', 'result', 'usage', 'error')
  return '{"id":' .. jstr(f[1]) .. ',"object":"job","model":' .. jstr(f[2]) .. ',"status":' .. jstr(f[3])
    .. ',"priority":' .. jstr(f[4]) .. ',"created_at":' .. jraw(f[5])
    .. ',"timings":{"queued_at":' .. jraw(f[5]) .. ',"started_at":' .. jraw(f[6])
    .. ',"first_token_at":' .. jraw(f[7]) .. ',"finished_at":' .. jraw(f[8]) .. ',"deadline":' .. jraw(f[9])
    .. '},"attempts":' .. jraw(f[10]) .. ',"result":' .. jraw(f[11]) .. ',"usage":' .. jraw(f[12])
    .. ',"error":' .. jraw(f[13]) .. '}'
end

-- Puts a job in a terminal state, publishes its terminal event and starts its result TTL: the
-- results zset drives removal on the caller's clock; the Redis TTL (a minute later) only catches
-- records that no maintenance round ever reaped.
local function settle(id, state, err)
  local jk, ok = job_key(J.P, id), out_key(J.P, id)
  local cur = redis.call('HMGET', jk, 'state', 'model')
  if cur[1] == 'running' then
    redis.call('HINCRBY', J.running, cur[2], -1)
  end
  redis.call('HSET', jk, 'state', state, 'finished_at', J.now_s)
  if err then
    redis.call('HSET', jk, 'error', err)
  end
  redis.call('ZADD', J.results, J.now + J.ttl, id)
  local etype = 'error'
  if state == 'succeeded' then etype = 'done' end
  emit(jk, ok, etype, view(jk))
  local ms = math.ceil(J.ttl * 1000) + 60000
  redis.call('PEXPIRE', jk, ms)
  redis.call('PEXPIRE', ok, ms)
end
