-- Shared: the worker registry. A worker not refreshed before its registration expires is presumed
-- dead and its slots stop counting. The slots hash keeps the totals over live workers so that admit
-- reads one field; it is rebuilt only when a worker comes, changes or goes.
--   workers zset: worker -> expiry;  wslots hash: worker -> JSON {model: slots};  slots hash: model -> total

local function workers_rebuild(workers, wslots, slots)
  redis.call('DEL', slots)
  local live = redis.call('ZRANGE', workers, 0, -1)
  for _, w in ipairs(live) do
    local js = redis.call('HGET', wslots, w)
    if js then
      for model, n in pairs(cjson.decode(js)) do
        redis.call('HINCRBY', slots, model, n)
      end
    end
  end
end

-- Drops the workers whose registration expired before now; true when any was dropped.
local function workers_expire(workers, wslots, now_s)
  local gone = redis.call('ZRANGEBYSCORE', workers, '-inf', '(' .. now_s)
  if #gone == 0 then return false end
  redis.call('ZREMRANGEBYSCORE', workers, '-inf', '(' .. now_s)
  redis.call('HDEL', wslots, unpack(gone))
  return true
end

local function workers_refresh(workers, wslots, slots, now_s)
  if workers_expire(workers, wslots, now_s) then
    workers_rebuild(workers, wslots, slots)
  end
end
