-- workers: the registry of live workers and their slots per model.
--
-- KEYS[1] workers zset   KEYS[2] worker slots hash   KEYS[3] capacity hash
-- ARGV[1] now   ARGV[2] 'register' | 'unregister' | 'list'   ARGV[3] worker id
-- ARGV[4] registration expiry (register)   ARGV[5] JSON {model: slots} (register)
-- Returns the capacity hash after the change, flat: field, value, ... (slots are the s:<model> fields)

-- @include _workers.lua

local workers_k, wslots_k, capacity_k = KEYS[1], KEYS[2], KEYS[3]
local now_s, op, worker, expires, slots = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]

local changed = workers_expire(workers_k, wslots_k, now_s)
if op == 'register' then
  if rcall('HGET', wslots_k, worker) ~= slots then
    rcall('HSET', wslots_k, worker, slots)
    changed = true
  end
  rcall('ZADD', workers_k, expires, worker)
elseif op == 'unregister' then
  if rcall('ZREM', workers_k, worker) == 1 then changed = true end
  rcall('HDEL', wslots_k, worker)
end
if changed then workers_rebuild(workers_k, wslots_k, capacity_k) end
workers_mark(workers_k, capacity_k)
return rcall('HGETALL', capacity_k)
