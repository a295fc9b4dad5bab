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

local pending_k, inflight_k, job_k = KEYS[1], KEYS[2], KEYS[3]
local op, now_s = ARGV[1], ARGV[2]
local now = now_s * 1

if op == 'take' then
  local lease_s, most = ARGV[3] * 1, ARGV[4] * 1
  for _, id in ipairs(rcall('ZRANGEBYSCORE', inflight_k, '-inf', now_s)) do
    rcall('ZREM', inflight_k, id)
    rcall('RPUSH', pending_k, id) -- its worker went quiet: hand it out again
  end
  local ids = rcall('LRANGE', pending_k, 0, most - 1)
  if #ids > 0 then
    rcall('LTRIM', pending_k, #ids, -1)
    for _, id in ipairs(ids) do rcall('ZADD', inflight_k, now + lease_s, id) end
  end
  return ids
elseif op == 'ack' then
  local id = ARGV[3]
  return rcall('ZREM', inflight_k, id)
elseif op == 'extra' then
  local before, after = ARGV[3], ARGV[4]
  local cur = rcall('HGET', job_k, 'extra')
  if not cur then return -1 end
  if cur ~= before then return 0 end
  rcall('HSET', job_k, 'extra', after)
  return 1
end
return redis.error_reply('unknown op ' .. op)
