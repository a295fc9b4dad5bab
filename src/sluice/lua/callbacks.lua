-- callbacks: the jobs that ended with a callback_url, handed to workers to deliver their webhooks.
-- settle() queues them; 'take' hands them out under a lease (a worker that dies leaves them to be
-- handed out again when it runs out); 'ack' says one was delivered or given up on; 'extra' records
-- a delivery attempt in the job's extra field if nobody changed it meanwhile.
--
-- KEYS[1] pending list   KEYS[2] in-flight zset (job id -> lease expiry)   KEYS[3] job hash ('extra')
-- ARGV[1] op   ARGV[2] now
--   take:  ARGV[3] lease seconds   ARGV[4] most ids to hand out   -> the ids
--   ack:   ARGV[3] job id                                          -> 1 when it was in flight
--   extra: ARGV[3] the extra JSON read before   ARGV[4] the new one -> 1 when written, 0 when it
--          changed meanwhile (read again and retry), -1 when the job is gone

local op, now = ARGV[1], tonumber(ARGV[2])
if op == 'take' then
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', ARGV[2])) do
    redis.call('ZREM', KEYS[2], id)
    redis.call('RPUSH', KEYS[1], id) -- its worker went quiet: hand it out again
  end
  local ids = redis.call('LRANGE', KEYS[1], 0, tonumber(ARGV[4]) - 1)
  if #ids > 0 then
    redis.call('LTRIM', KEYS[1], #ids, -1)
    for _, id in ipairs(ids) do redis.call('ZADD', KEYS[2], now + tonumber(ARGV[3]), id) end
  end
  return ids
elseif op == 'ack' then
  return redis.call('ZREM', KEYS[2], ARGV[3])
elseif op == 'extra' then
  local cur = redis.call('HGET', KEYS[3], 'extra')
  if not cur then return -1 end
  if cur ~= ARGV[3] then return 0 end
  redis.call('HSET', KEYS[3], 'extra', ARGV[4])
  return 1
end
return redis.error_reply('unknown op ' .. op)
