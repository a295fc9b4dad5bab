-- heartbeat: renew the leases a worker holds, in one call for all its jobs (like BullMQ extendLocks).
-- A job is the worker's while it is in the active zset with this worker as owner and, when the
-- caller knows it, the lease token of its claim. Jobs it no longer holds, or that reached a terminal
-- state (cancelled while running), are returned so the worker aborts them; a terminal job's lease is
-- released here, as nobody will finish it.
--
-- KEYS[1] active zset   KEYS[2 ..] the job hashes
-- ARGV[1] now   ARGV[2] lease seconds   ARGV[3] worker id
-- ARGV[4 ..] job id, lease token ('' when unknown) per job, in KEYS order
-- Returns the ids to abort.

local active_k = KEYS[1]
local JOBS_AT = 2 -- KEYS[JOBS_AT ..]: the job hashes
local now, lease_s, worker = ARGV[1] * 1, ARGV[2] * 1, ARGV[3]
local PAIRS_AT = 4 -- ARGV[PAIRS_AT ..]: job id, lease token per job

local abort = {}
for j = 0, #KEYS - JOBS_AT do
  local id, token = ARGV[PAIRS_AT + 2 * j], ARGV[PAIRS_AT + 2 * j + 1]
  local f = rcall('HMGET', KEYS[JOBS_AT + j], 'state', 'worker', 'lease')
  local mine = rcall('ZSCORE', active_k, id) and f[2] == worker and (token == '' or f[3] == token)
  if mine and f[1] == 'running' then
    rcall('ZADD', active_k, 'XX', now + lease_s, id)
  else
    abort[#abort + 1] = id
    if mine then rcall('ZREM', active_k, id) end
  end
end
return abort
