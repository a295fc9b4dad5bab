-- publish: append an event to a running job's stream; the first token stamps first_token_at.
--
-- KEYS[1] job hash   KEYS[2] event stream
-- ARGV[1] now   ARGV[2] event type   ARGV[3] data (JSON)   ARGV[4] events kept per stream
-- Returns the event's id, or 0 when the job is not running (nothing is appended).

if redis.call('HGET', KEYS[1], 'state') ~= 'running' then return 0 end
if ARGV[2] == 'token' and redis.call('HEXISTS', KEYS[1], 'first_token_at') == 0 then
  redis.call('HSET', KEYS[1], 'first_token_at', ARGV[1])
end
local seq = redis.call('HINCRBY', KEYS[1], 'seq', 1)
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '0-' .. seq, 't', ARGV[2], 'd', ARGV[3])
return seq
