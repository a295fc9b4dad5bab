-- publish: append an event to a running job's stream; the first token stamps first_token_at.
--
-- KEYS[1] job hash   KEYS[2] event stream
-- ARGV[1] now   ARGV[2] event type   ARGV[3] data (JSON)   ARGV[4] events kept per stream
-- Returns the event's id, or 0 when the job is not running (nothing is appended).

local job_k, stream_k = KEYS[1], KEYS[2]
local now_s, etype, data, maxlen = ARGV[1], ARGV[2], ARGV[3], ARGV[4]

if rcall('HGET', job_k, 'state') ~= 'running' then return 0 end
if etype == 'token' and rcall('HEXISTS', job_k, 'first_token_at') == 0 then
  rcall('HSET', job_k, 'first_token_at', now_s)
end
local seq = rcall('HINCRBY', job_k, 'seq', 1)
rcall('XADD', stream_k, 'MAXLEN', '~', maxlen, '0-' .. seq, 't', etype, 'd', data)
return seq
