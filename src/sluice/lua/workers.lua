-- workers: the registry of live workers and their slots per model.
--
-- KEYS[1] workers zset   KEYS[2] worker slots hash   KEYS[3] capacity hash
-- ARGV[1] now   ARGV[2] 'register' | 'unregister' | 'list'   ARGV[3] worker id
-- ARGV[4] registration expiry (register)   ARGV[5] JSON {model: slots} (register)
-- Returns the capacity hash after the change, flat: field, value, ... (slots are the s:<model> fields)

-- @include _workers.lua

local now_s, op, worker = ARGV[1], ARGV[2], ARGV[3]
local changed = workers_expire(KEYS[1], KEYS[2], now_s)
if op == 'register' then
  if redis.call('HGET', KEYS[2], worker) ~= ARGV[5] then
    redis.call('HSET', KEYS[2], worker, ARGV[5])
    changed = true
  end
  redis.call('ZADD', KEYS[1], ARGV[4], worker)
elseif op == 'unregister' then
  if redis.call('ZREM', KEYS[1], worker) == 1 then changed = true end
  redis.call('HDEL', KEYS[2], worker)
end
if changed then workers_rebuild(KEYS[1], KEYS[2], KEYS[3]) end
workers_mark(KEYS[1], KEYS[3])
return redis.call('HGETALL', KEYS[3])
