-- connect: take one of an API key's connection slots, if one is free: the count and the take in
-- one step, so that gateways racing for the last slot cannot both have it (MemoryBroker.open_connection).
-- Entries whose lease lapsed (their gateway died and renews nothing) are dropped first.
--
-- KEYS[1] the key's connections zset (QueueKeys.connections): connection id -> lease expiry
-- ARGV[1] now   ARGV[2] connection id   ARGV[3] cap   ARGV[4] lease expiry
-- ARGV[5] the zset's own time to live (ms), renewed with every take
-- Returns 1 when the slot was taken, 0 when `cap` connections are open already.

local conns_k = KEYS[1]
local now_s, conn, cap, expires, ttl_ms = ARGV[1], ARGV[2], ARGV[3] * 1, ARGV[4], ARGV[5]

rcall('ZREMRANGEBYSCORE', conns_k, '-inf', '(' .. now_s)
if rcall('ZCARD', conns_k) >= cap then return 0 end
rcall('ZADD', conns_k, expires, conn)
rcall('PEXPIRE', conns_k, ttl_ms)
return 1
