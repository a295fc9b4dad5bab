-- Shared: the worker registry. A worker not refreshed before its registration expires is presumed
-- dead and its slots stop counting. The capacity hash keeps s:<model>, the slots of the live workers,
-- so that admit reads it with the drain rate in one call; it is rebuilt only when a worker comes,
-- changes or goes. It also keeps 'e', the earliest registration expiry (or less), so that admit
-- looks at the registry only once some worker may have expired.
--   workers zset: worker -> expiry;  wslots hash: worker -> JSON {model: slots}

local function workers_rebuild(workers, wslots, capacity)
  local total = {}
  for _, w in ipairs(rcall('ZRANGE', workers, 0, -1)) do
    local js = rcall('HGET', wslots, w)
    if js then
      for model, n in pairs(cjson.decode(js)) do
        total[model] = (total[model] or 0) + n
      end
    end
  end
  local fields = rcall('HKEYS', capacity)
  local gone = {}
  for _, f in ipairs(fields) do
    if string.sub(f, 1, 2) == 's:' and total[string.sub(f, 3)] == nil then gone[#gone + 1] = f end
  end
  if #gone > 0 then rcall('HDEL', capacity, unpack(gone)) end
  local sets = {}
  for model, n in pairs(total) do
    sets[#sets + 1] = 's:' .. model
    sets[#sets + 1] = n
  end
  if #sets > 0 then rcall('HSET', capacity, unpack(sets)) end
end

-- Drops the workers whose registration expired before now; true when any was dropped.
local function workers_expire(workers, wslots, now_s)
  local gone = rcall('ZRANGEBYSCORE', workers, '-inf', '(' .. now_s)
  if #gone == 0 then return false end
  rcall('ZREMRANGEBYSCORE', workers, '-inf', '(' .. now_s)
  rcall('HDEL', wslots, unpack(gone))
  return true
end

local function workers_refresh(workers, wslots, capacity, now_s)
  if workers_expire(workers, wslots, now_s) then
    workers_rebuild(workers, wslots, capacity)
  end
end

local function workers_mark(workers, capacity)
  local first = rcall('ZRANGE', workers, 0, 0, 'WITHSCORES')
  if #first == 0 then
    rcall('HDEL', capacity, 'e')
  else
    rcall('HSET', capacity, 'e', first[2])
  end
end
