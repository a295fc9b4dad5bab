-- purge_dead: forget dead letters, records and events included.
--
-- KEYS[1] dead zset   KEYS[2] results zset
-- ARGV[1] queue prefix   ARGV[2 ..] the job ids (none: every dead letter)
-- Returns how many went.
-- Builds job and stream keys from the prefix (same slot as KEYS).

-- @include _keys.lua

local dead_k, results_k = KEYS[1], KEYS[2]
local P = ARGV[1]
local IDS_AT = 2 -- ARGV[IDS_AT ..]: the job ids

local ids = {}
if #ARGV >= IDS_AT then
  for i = IDS_AT, #ARGV do ids[#ids + 1] = ARGV[i] end
else
  ids = rcall('ZRANGE', dead_k, 0, -1)
end
local gone = 0
for _, id in ipairs(ids) do
  if rcall('ZREM', dead_k, id) == 1 then
    rcall('DEL', job_key(P, id), out_key(P, id))
    rcall('ZREM', results_k, id)
    gone = gone + 1
  end
end
return gone
