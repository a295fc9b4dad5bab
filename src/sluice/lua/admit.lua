-- admit: idempotency, the tenant's limits, the queue's bounds and the queue policy's decision, then
-- the enqueue: all or nothing. Mirrors the memory broker's _admit (admission.check_tenant with its
-- TenantLimiter, then QueuePolicy.admit, here _policy.lua); on refusal it returns the state those
-- need, and Python re-runs them on it to raise the same Refused (status, code, message,
-- Retry-After, rate). Its reply is decoded by redis_codec.AdmitReply.
--
-- KEYS[1]  job hash                 KEYS[2]  event stream of the job (not written: see 'q')
-- KEYS[3]  the tenant's list        KEYS[4]  sched zset of the job's class
-- KEYS[5]  idempotency key (KEYS[1] again when the job has none)
-- KEYS[6]  state hash of the model  KEYS[7]  deadline zset      KEYS[8]  models set
-- KEYS[9]  capacity hash            KEYS[10] workers zset       KEYS[11] worker slots hash
-- KEYS[12] marker of the model     KEYS[13] tenant hash          KEYS[14] blocked set
-- KEYS[15] running hash             KEYS[16] capped set           KEYS[17] results zset
-- KEYS[18] the tenant's list of jobs (QueueKeys.tenant_jobs_us), when it is in this shard (the
--          home shard's); else this shard's jobs not yet listed (QueueKeys.unlisted): a queued job
--          joins it, the caller lists it (RedisJobs._list_job) and takes it out, and upkeep lists
--          it if that failed (RedisJobs._repair_listing). Absent (an older caller): neither.
-- ARGV[1]  now                      ARGV[2]  job id             ARGV[3]  tenant
-- ARGV[4]  cost                     ARGV[5]  deadline
-- ARGV[6]  idempotency TTL s (0: the job has no key)
-- ARGV[7]  1 when limits come with the job, else 0 (none are checked; the tenant's cap stays)
-- ARGV[8]  the key's bucket id (TenantLimits.bucket_id)
-- ARGV[9]  rpm   ARGV[10] tpm   ARGV[11] max queued   ARGV[12] max concurrent   (-1: none)
-- ARGV[13] the settings (settings_of in _keys.lua; redis_codec.settings_text of the job's model, class
--   and bounds, then RedisCore._admit_settings), joined by byte 31:
--   1 model  2 the job's class  3 model max jobs  4 model max tokens  5 class max jobs
--   6 class max tokens (-1: unbounded)  7 drain prior per slot
--   8 the queue policy's kind  9 .. 13 its five numbers (QueuePolicy.lua_args)
--   14 .. 19 the promise's (capacity.promise_args): EXTRAPOLATION_SHARE, WAIT_MARGIN_Z, the drain
--          rate's alpha, 1 when it is weighed per slot (DrainRate.promise_rate), FILL_GAP_SHARE,
--          FILL_GAP_SD (DrainRate.promise_slowdown)
--   20 result TTL s  21 events kept per stream  22 error JSON of an evicted job (core.errors.evicted_error)
--   23 shortest, 24 longest Retry-After (admission.clamp_retry_after)
--   25 RETRY_PATIENCE_S  26 RETRY_SHARE (admission.reserve)
--   27 capacity.FILL_RIDGE  28 capacity.MAX_FILL_SLOWDOWN (DrainRate.slowdown)
--   29 .. the class names, highest first
-- ARGV[14] the job's score in the tenant's list (redis_codec.created_us), ARGV[15] the list's
--          expiry in ms, at least (both '' when KEYS[18] is not the tenant's list)
-- ARGV[16 ..] field, value pairs of the job record (sluice.broker.redis_codec)
-- Returns {1, position, estimated_start_s, T...}     queued; T is the tenant after the charge
--         {2, first job id}                          the idempotency key names an earlier live job
--         {3}                                        this job id is already admitted (a retried call)
--         {0, model_jobs, model_tokens, class_jobs, class_tokens, ahead_jobs, ahead_tokens,
--             runnable_tokens, per_slot, samples, slots, T..., running, S..., victim_tokens,
--             next_free, slow, fill, resid, service}
--                                                    refused; T is the tenant before the checks,
--                                                    S the policy state before them
-- where T is the key's rpm, tpm and max queued, the tenant's max concurrent and queued jobs, the
-- key's requests level, stamp, tokens level, stamp ('' for none), and S is codel's four fields
-- ('' for none; see _policy.lua). The ahead counts are the fair order's (ClassScheduler.fair_view,
-- the memory broker's _view): the classes above, and in the job's class its tenant's jobs and
-- those of other tenants that start before it (work_before); they leave out the jobs other
-- tenants hold back by their concurrency caps, and runnable_tokens those that every cap holds
-- back, this job's tenant's too (ClassScheduler.held_back).
-- victim_tokens is the cost of the newest job of the heaviest backlog of the class ('' for none,
-- and when no bound is reached, as nothing then reads it): when a bound is reached and evicting
-- it makes room, that job ends as failed and this one is queued (admission.check_bounds).
-- next_free is the reservation book before this refusal ('' for none): a queue's refusal reserves the capacity its Retry-After names (admission.reserve, in the
-- state hash's field 'rv'), so that the refusals of a burst get distinct times, spread over the
-- capacity that frees; a refusal of the tenant's own limits reserves nothing. slow is how slow a
-- job gets, per cost unit (DrainRate.slow): the deadline check promises a job its generation at
-- that pace (DrainRate.slow_service_s); fill is the model's fill fit (the 'g:' field, '' for none),
-- how a job slows as the batch fills (DrainRate.slowdown), which the rate and that pace are at.
-- Reads the earlier job's record for idempotency, the hashes and lists of the tenants in the
-- capped set and the lists of the tenants backlogged in the job's class (their keys built from the
-- prefix, same slot), and of their head jobs what the state hash's hd: fields do not hold (head_of
-- below; it stores there what it read).

-- @include _keys.lua
-- @include _state.lua
-- @include _tenant.lua
-- @include _job.lua
-- @include _fairqueue.lua
-- @include _workers.lua
-- @include _drain.lua
-- @include _policy.lua

local job_k, tq_k, sched_k, idem_k = KEYS[1], KEYS[3], KEYS[4], KEYS[5]
local state_k, deadline_k, models_k, capacity_k = KEYS[6], KEYS[7], KEYS[8], KEYS[9]
local workers_k, wslots_k, marker_k, tenant_k = KEYS[10], KEYS[11], KEYS[12], KEYS[13]
local blocked_k, running_k, capped_k, results_k = KEYS[14], KEYS[15], KEYS[16], KEYS[17]

-- The settings, parsed once per text (settings_of): the numbers, the classes, and the names
-- built from the model and the class (the state fields the one HMGET below always reads, the
-- capacity hash's fields of the model).
local function parse_settings(v)
  local s = { model = v[1], cls = v[2], policy = {}, classes = {} }
  s.model_max_jobs, s.model_max_tokens = tonumber(v[3]), tonumber(v[4])
  s.class_max_jobs, s.class_max_tokens = tonumber(v[5]), tonumber(v[6])
  s.drain_prior, s.policy_kind = tonumber(v[7]), tonumber(v[8])
  for i = 1, 5 do s.policy[i] = tonumber(v[8 + i]) end
  s.extrapolation, s.margin_z = tonumber(v[14]), tonumber(v[15])
  s.drain_alpha, s.per_slot_weight = tonumber(v[16]), v[17] == '1'
  s.gap_share, s.gap_sd = tonumber(v[18]), tonumber(v[19])
  s.result_ttl, s.maxlen, s.evicted_error = tonumber(v[20]), v[21], v[22]
  s.retry_bounds = { tonumber(v[23]), tonumber(v[24]) }
  s.patience, s.share = tonumber(v[25]), tonumber(v[26])
  s.fill_ridge, s.max_slowdown = tonumber(v[27]), tonumber(v[28])
  for i = 29, #v do s.classes[#s.classes + 1] = v[i] end
  local m = s.model
  s.capacity_fields = { 'p:' .. m, 'n:' .. m, 's:' .. m, 'e', 'h:' .. m, 'g:' .. m, 'r:' .. m, 'd:' .. m }
  s.f_vtime, s.f_seq = f_vtime(s.cls), f_seq(s.cls)
  s.f_jobs, s.f_tokens = {}, {}
  for i, c in ipairs(s.classes) do s.f_jobs[i], s.f_tokens[i] = f_jobs(c), f_tokens(c) end
  -- the state fields every admission reads, in the order of the HMGET (then the tenants' own)
  s.fields = class_fields(s.classes)
  s.fields[#s.fields + 1] = s.f_vtime
  s.fields[#s.fields + 1] = s.f_seq
  s.fields[#s.fields + 1] = 'ht' -- F_ENCODING, below
  if s.policy_kind == 4 then -- only codel keeps state
    for _, f in ipairs(POLICY_FIELDS) do s.fields[#s.fields + 1] = f end
  end
  s.names, s.names_P = nil, nil -- names_of's memo, and the prefix it is for
  return s
end
local S = settings_of('admit', ARGV[13], parse_settings)

-- A tenant's list of the job's model and class and its two state fields there (work, tag),
-- memoized with the settings for the shard's prefix P (bounded as part's memo is).
local function names_of(P, tenant)
  if S.names_P ~= P then S.names, S.names_P = new_memo(PARTS_MAX), P end
  local n = S.names.t[tenant]
  if n == nil then
    local tq = tq_key(P, S.model, S.cls, tenant)
    n = memo_put(S.names, tenant, { tq, f_work(tq), f_tag(S.cls, tenant) })
  end
  return n
end

local now_s, id, tenant, model, cls = ARGV[1], ARGV[2], ARGV[3], S.model, S.cls
local now, cost, deadline = now_s * 1, ARGV[4] * 1, ARGV[5] * 1
local model_max_jobs, model_max_tokens = S.model_max_jobs, S.model_max_tokens
local class_max_jobs, class_max_tokens = S.class_max_jobs, S.class_max_tokens
local drain_prior, idem_ttl = S.drain_prior, ARGV[6] * 1
local limits_given, bucket = ARGV[7] == '1', ARGV[8]
local given_limits = { ARGV[9], ARGV[10], ARGV[11], ARGV[12] } -- rpm, tpm, max queued, max concurrent
local policy_kind, policy = S.policy_kind, S.policy
local extrapolation, margin_z = S.extrapolation, S.margin_z
local gap_share, gap_sd = S.gap_share, S.gap_sd
local drain_alpha, per_slot_weight = S.drain_alpha, S.per_slot_weight
local result_ttl, maxlen, evicted_error = S.result_ttl, S.maxlen, S.evicted_error
local retry_bounds = S.retry_bounds
local patience, share = S.patience, S.share
local fill_ridge, max_slowdown = S.fill_ridge, S.max_slowdown
local classes = S.classes
local RECORD_AT = 16 -- ARGV[RECORD_AT ..]: the job record's field, value pairs
local P = string.sub(job_k, 1, -(#id + 5)) -- job_k is P .. 'job:' .. id
J.P, J.now, J.now_s, J.ttl, J.maxlen = P, now, now_s, result_ttl, maxlen
J.results, J.running, J.blocked = results_k, running_k, blocked_k

if rcall('EXISTS', job_k) == 1 then return { 3 } end

if idem_ttl > 0 then
  local hit = rcall('GET', idem_k)
  if hit then
    local sp = string.find(hit, ' ', 1, true)
    local first = string.sub(hit, 1, sp - 1)
    if string.sub(hit, sp + 1) * 1 > now and rcall('EXISTS', job_key(P, first)) == 1 then
      return { 2, first }
    end
  end
end

-- The tenant and the buckets of the job's key (the memory broker's _tenant and _key_limiter): the
-- limits that come with the job are the key's as they are now. Its buckets keep their levels
-- through a change of its limits (TenantLimiter.update: refilled at the new rate up to the new
-- size); a limit that went away takes its bucket along. The tenant's cap is the key's.
local t = {}
local flat = rcall('HGETALL', tenant_k)
for i = 1, #flat, 2 do t[flat[i]] = flat[i + 1] end
local had_mc = t.mc ~= nil
local B = bucket_fields(bucket)
local rpm, tpm, mq, mc = nil, nil, nil, tonum(t.mc)
if limits_given then
  local v = {}
  for i = 1, 4 do
    v[i] = tonumber(given_limits[i])
    if v[i] < 0 or (v[i] == 0 and i <= 2) then v[i] = nil end -- a zero-sized bucket is no bucket
  end
  rpm, tpm, mq, mc = v[1], v[2], v[3], v[4]
end
local queued_by_tenant = (t.q or 0) * 1
local running_by_tenant = (t.r or 0) * 1
-- The admission raised (or lifted) the cap of a tenant that was at it, with `held` jobs queued
-- before this one, accepted or refused (the key's limits are stored either way): the jobs it held
-- back, in any model of this shard (the cap spans them) and this one, may run now, and their
-- claimers wake, as settle wakes them when a running job's end frees the slot
-- (MemoryBroker._key_limiter wakes every claim then).
local function wake_if_cap_freed(held)
  local old_mc = tonum(t.mc)
  if held > 0 and old_mc and running_by_tenant >= old_mc and not (mc and running_by_tenant >= mc) then
    for _, m in ipairs(rcall('SMEMBERS', models_k)) do rcall('ZADD', marker_key(P, m), '0', 'w') end
  end
end
local function tenant_state(rl, rs, tl, ts)
  local vals, out = { rpm, tpm, mq, mc, queued_by_tenant, rl, rs, tl, ts }, {}
  for i = 1, 9 do -- not ipairs: absent values are holes
    if vals[i] == nil then out[i] = '' else out[i] = num_text(vals[i]) end
  end
  return out
end
local old_rl, old_rs, old_tl, old_ts = nil, nil, nil, nil -- the key's levels, of the limits it has now
if rpm then old_rl, old_rs = tonum(t[B.rl]), tonum(t[B.rs]) end
if tpm then old_tl, old_ts = tonum(t[B.tl]), tonum(t[B.ts]) end
-- (the tenant's state before the checks, for a refusal's reply, is made there: nothing it reads
-- changes before then)

-- Stores the tenant: its counts and cap, the key's buckets; a tenant with no jobs and no buckets
-- left is forgotten (tenant_move does the same).
local function tenant_store(rl, rs, tl, ts)
  local mine, ours = {}, {} -- the key's buckets now; the fields they may have
  if limits_given then
    mine = { [B.rl] = rl, [B.rs] = rs, [B.tl] = tl, [B.ts] = ts }
    if tl then mine[B.tpm] = tpm end
    ours = { [B.rl] = true, [B.rs] = true, [B.tpm] = true, [B.tl] = true, [B.ts] = true }
  end
  local sets = { 'q', int_text(queued_by_tenant), 'r', int_text(running_by_tenant) }
  local dels, buckets = {}, false -- buckets: whether the tenant has any left
  for f in pairs(t) do
    if not TENANT_OWN_FIELDS[f] and mine[f] == nil then
      if not ours[f] and string.find(f, ':', 1, true) then
        buckets = true -- another key's
      else
        dels[#dels + 1] = f -- a bucket of this key that went, or a field of an older layout
      end
    end
  end
  for f, v in pairs(mine) do
    table.insert(sets, f)
    table.insert(sets, num(v))
    buckets = true
  end
  if queued_by_tenant <= 0 and running_by_tenant <= 0 and not buckets then
    if next(flat) ~= nil then rcall('DEL', tenant_k) end
    tenant_sets(P, blocked_k, tenant, 0, 0, nil, had_mc)
    return
  end
  if mc then
    table.insert(sets, 'mc')
    table.insert(sets, mc)
  elseif had_mc then
    dels[#dels + 1] = 'mc'
  end
  rcall('HSET', tenant_k, unpack(sets))
  if #dels > 0 then rcall('HDEL', tenant_k, unpack(dels)) end
  tenant_sets(P, blocked_k, tenant, queued_by_tenant, running_by_tenant, mc, had_mc)
end

-- TenantLimiter.check: both buckets refilled; the longer wait decides (tokens on a tie).
local rl, rs, tl, ts
local wait_r, wait_t = 0.0, 0.0
if rpm then
  rl, rs = bucket_refill(old_rl, old_rs, rpm, now)
  if 1 > rl then
    if 1 > rpm then wait_r = math.huge else wait_r = (1 - rl) / (rpm / 60.0) end
  end
end
if tpm then
  tl, ts = bucket_refill(old_tl, old_ts, tpm, now)
  if cost > tl then
    if cost > tpm then wait_t = math.huge else wait_t = (cost - tl) / (tpm / 60.0) end
  end
end

-- The class's backlogged tenants other than this one, in heap order (stale entries too: their
-- lists are empty), first: their fair-queue fields come in the same HMGET as the state's own.
-- (Blocks of do ... end keep the main function under Lua's 200 local variables.)
local others, others_tq, others_w, others_t = {}, {}, {}, {} -- their names, lists, work and tag fields
local others_read = false -- whether others_wv, _tv and _hv hold their work, tag and head, read with the state
local others_wv, others_tv, others_hv = {}, {}, {}
local own_w, own_t, own_h = f_work(tq_k), f_tag(cls, tenant), f_head(tq_k) -- this tenant's
local st
do
  -- the state hash's field that keeps it a hashtable (below), and its value, over 64 bytes
  local F_ENCODING = 'ht'
  local ENCODING_NOTE = 'a value over hash-max-listpack-value: this hash stays a hashtable (admit.lua)'
  local seen = { [tenant] = true }
  for _, member in ipairs(rcall('ZRANGE', sched_k, '0', '-1')) do
    local other = string.sub(member, 16)
    if not seen[other] then
      seen[other] = true
      local n, names = #others + 1, names_of(P, other)
      others[n], others_tq[n], others_w[n], others_t[n] = other, names[1], names[2], names[3]
    end
  end
  -- the settings' fields (the classes', the class's vtime and sequence, F_ENCODING, codel's), then
  -- this tenant's and the others'
  local fields = { unpack(S.fields) } -- made at its size at once, not grown by appends
  fields[#fields + 1] = own_t
  fields[#fields + 1] = f_finish(cls, tenant)
  fields[#fields + 1] = own_w
  fields[#fields + 1] = own_h
  local own_fields = #fields
  others_read = #others <= 1000 -- an HMGET of ~3,000 fields at most (Lua's unpack has a limit)
  if others_read then
    for i = 1, #others do
      fields[#fields + 1] = others_w[i]
      fields[#fields + 1] = others_t[i]
      fields[#fields + 1] = f_head(others_tq[i])
    end
  end -- else they are read one by one as the loop meets them
  -- the others' fields are read once, by the loop over the backlogs below, before any write: they
  -- stay out of the view (st_open)
  local got
  st, got = st_open(state_k, fields, own_fields)
  if others_read then
    for i = 1, #others do
      local at = own_fields + 3 * i
      others_wv[i], others_tv[i], others_hv[i] = got[at - 2], got[at - 1], got[at]
    end
  end
  -- A hash of a few dozen fields is a listpack to Redis, read by a scan of every field for each
  -- field read (about 5.5 k instructions a field at 45 fields, against 2.5 k in a hashtable,
  -- measured with callgrind); the scripts read and write some 40 fields of it per cycle. One
  -- value longer than hash-max-listpack-value (64 bytes by default) makes it a hashtable for good.
  if not st.v[F_ENCODING] then st_set(st, F_ENCODING, ENCODING_NOTE) end
end
local policy_before = { '', '', '', '' }
if policy_kind == 4 then policy_before = policy_state(st) end

local model_jobs, model_tokens, class_jobs, class_tokens, ahead_jobs, ahead_tokens = 0, 0, 0, 0, 0, 0
do
  local above = true
  for i, c in ipairs(classes) do
    local j, k = st_num(st, S.f_jobs[i], 0), st_num(st, S.f_tokens[i], 0)
    model_jobs, model_tokens = model_jobs + j, model_tokens + k
    if c == cls then
      class_jobs, class_tokens, above = j, k, false
    elseif above then
      ahead_jobs, ahead_tokens = ahead_jobs + j, ahead_tokens + k
    end
  end
end

-- ClassScheduler.fair_view. First the jobs a tenant holds back by its concurrency cap: another
-- tenant's are not ahead of this one, and nobody's are in the engine's queue that codel reads
-- (runnable_tokens; ClassScheduler.held_back: beyond the first `room` it may start, its higher
-- classes first, its own order inside a class). Only tenants in the capped set have any; this
-- job's tenant counts with the cap its key has now (the memory broker's rooms, after _key_limiter).
local runnable_tokens = model_tokens
local held_n, kept_k = {}, {} -- of a capped tenant: its jobs of this class held back; the cost of the rest
local rooms = {} -- { tenant, room }: the capped tenants and how many more of their jobs may start
local held_jobs = 0 -- the model's queued jobs held back, of every class: none of them can be claimed
for _, other in ipairs(rcall('SMEMBERS', capped_k)) do
  if other ~= tenant then
    local o = rcall('HMGET', tenant_key(P, other), 'r', 'mc')
    local cap = tonum(o[2])
    if cap then rooms[#rooms + 1] = { other, math.max(cap - (o[1] or 0) * 1, 0) } end
  end
end
if mc and queued_by_tenant + running_by_tenant > mc then
  rooms[#rooms + 1] = { tenant, math.max(mc - running_by_tenant, 0) }
end
for _, capped in ipairs(rooms) do
  local other, room = capped[1], capped[2]
  local is_above = true
  for _, c in ipairs(classes) do
    local tq = tq_key(P, model, c, other)
    local n = rcall('LLEN', tq)
    if c == cls then is_above = false end
    if n > room then -- FairQueue.held_back
      local kept = 0
      if room > 0 then
        for _, jid in ipairs(rcall('LRANGE', tq, 0, room - 1)) do
          kept = kept + rcall('HGET', job_key(P, jid), 'cost')
        end
      end
      local held = st_num(st, f_work(tq), 0) - kept
      held_jobs = held_jobs + n - room
      runnable_tokens = runnable_tokens - held
      if other == tenant then -- its own jobs are all ahead of its next one
      elseif c == cls then
        held_n[other], kept_k[other] = n - room, kept
      elseif is_above then
        ahead_jobs, ahead_tokens = ahead_jobs - (n - room), ahead_tokens - held
      end
    end
    room = math.max(room - n, 0)
  end
end

-- FairQueue.start_tag of this job, then every other backlog of its class (FairQueue.backlogs).
-- own: the jobs of this job's tenant queued in its class; backlogs: the other tenants with jobs
-- queued in it, in heap order, with their jobs and tokens there (for the victim, below).
local own, backlogs, backlogs_n, backlogs_w = 0, {}, {}, {}
local own_head = nil -- '<cost> <weight> ' of this tenant's head job, when it has jobs queued here
do
  -- scheduler.work_before: the jobs and tokens of a backlog (n jobs of w tokens, its head at tag,
  -- of cost hc and weight hw) that start before a job whose start tag is `start`.
  local function work_before(n, w, tag, hc, hw, start)
    if n == 0 or tag > start then return 0, 0 end
    local span = w / hw
    if n == 1 or tag + span <= start then return n, w end
    local k = math.min(math.max(math.ceil((start - tag) * n / span - 1e-9), 1), n)
    if k == n then return n, w end
    return k, hc + math.floor((w - hc) * (k - 1) / (n - 1) + 0.5)
  end

  -- The head job's cost and weight of a tenant list tq of n jobs, its tenant's tag field `tag`
  -- (the text; nil: not known), and their texts. `cached` is the list's hd: field (_fairqueue.lua):
  -- while the list's length and the tag are those it was stored with, it is the head's; else the
  -- head job is read, and stored there (two calls fewer for each later admission that reads it).
  local function head_of(tq, n, tag, cached)
    local valid = tag and int_text(n) .. ':' .. tag
    if cached and valid then
      local hc, hw, at = string.match(cached, '^(%S+) (%S+) (.*)$')
      if at == valid then return hc * 1, hw * 1, hc, hw end
    end
    local h = rcall('HMGET', job_key(P, rcall('LINDEX', tq, '0')), 'cost', 'weight')
    local hw = h[2] or '1'
    if valid and h[1] then st_set(st, f_head(tq), h[1] .. ' ' .. hw .. ' ' .. valid) end
    return tonum(h[1]), hw * 1, h[1], hw
  end

  local vtime = st_num(st, S.f_vtime, 0)
  own = rcall('LLEN', tq_k)
  local start
  if own > 0 then
    local _, hw, hc_text, hw_text = head_of(tq_k, own, st.v[own_t], st.v[own_h])
    if hc_text then own_head = hc_text .. ' ' .. hw_text .. ' ' end
    local w = st_num(st, own_w, 0)
    start = st_num(st, own_t, vtime) + w / hw
    ahead_jobs, ahead_tokens = ahead_jobs + own, ahead_tokens + w
  else
    start = math.max(vtime, st_num(st, f_finish(cls, tenant), vtime))
  end
  for i, other in ipairs(others) do
    local tq = others_tq[i]
    local n = rcall('LLEN', tq)
    if n > 0 then
      local w, tag
      if others_read then
        w, tag = (others_wv[i] or 0) * 1, (others_tv[i] or 0) * 1
      else
        w, tag = st_num(st, others_w[i], 0), st_num(st, others_t[i], 0)
      end
      local jobs, tokens = 0, 0
      if tag <= start then
        local hc, hw = head_of(tq, n, others_tv[i], others_hv[i])
        jobs, tokens = work_before(n, w, tag, hc, hw, start)
      end
      if held_n[other] and n - held_n[other] < jobs then
        jobs, tokens = n - held_n[other], kept_k[other]
      end
      ahead_jobs, ahead_tokens = ahead_jobs + jobs, ahead_tokens + tokens
      local b = #backlogs + 1
      backlogs[b], backlogs_n[b], backlogs_w[b] = other, n, w
    end
  end
end

local d = rcall('HMGET', capacity_k, unpack(S.capacity_fields)) -- p:, n:, s:, e, h:, g:, r:, d:
local per_slot, samples, slots = (d[1] or 0) * 1, (d[2] or 0) * 1, (d[3] or 0) * 1
local slow, fill = (d[5] or 0) * 1, d[6] or ''
if d[4] and now > d[4] * 1 then -- some worker may have died: recount the slots
  workers_refresh(workers_k, wslots_k, capacity_k, now_s)
  workers_mark(workers_k, capacity_k)
  slots = (rcall('HGET', capacity_k, 's:' .. model) or 0) * 1
end

-- DrainRate.rate and slot_rate, in a full batch (DrainRate.slowdown)
local fill_numbers = fill_fit(fill)
local slowdown = fit_slowdown(fill_numbers, fill_ridge, max_slowdown)
local slot_rate = drain_prior
if samples > 0 then slot_rate = per_slot / slowdown end
local rate = math.max(slot_rate * math.max(slots, 1), 1e-3)
local avg_cost = cost
if model_jobs > 0 then avg_cost = model_tokens / model_jobs end

-- The excess over one scope's bounds, in tokens (0: within them).
local function over(max_jobs, max_tokens, jobs, tokens)
  local excess = 0
  if max_jobs >= 0 and jobs + 1 > max_jobs then excess = (jobs + 1 - max_jobs) * avg_cost end
  if max_tokens >= 0 and tokens + cost > max_tokens then
    excess = math.max(excess, tokens + cost - max_tokens)
  end
  return excess
end

-- admission.check_bounds: over a bound, the newest job of the heaviest backlog gives way if that
-- makes room, else the job is refused, with the time the first excess takes to drain.
-- The victim's job is read only over a bound (nothing else looks at it).
local evict = false
local excess = over(model_max_jobs, model_max_tokens, model_jobs, model_tokens)
if excess <= 0 then excess = over(class_max_jobs, class_max_tokens, class_jobs, class_tokens) end
local victim_id, victim_cost, victim, victim_n = nil, nil, nil, 0
if excess > 0 then
  -- the tenant of the heaviest other backlog, of victim_n jobs: the most jobs, then the most
  -- tokens, then the name last in Python's order of str (by code point, which is UTF-8's byte
  -- order; Lua's < follows the locale)
  local function name_after(a, b)
    for i = 1, math.min(#a, #b) do
      local x, y = string.byte(a, i), string.byte(b, i)
      if x ~= y then return x > y end
    end
    return #a > #b
  end
  local victim_w = 0
  for b, other in ipairs(backlogs) do
    local n, w = backlogs_n[b], backlogs_w[b]
    if victim == nil or n > victim_n or (n == victim_n and (w > victim_w
        or (w == victim_w and name_after(other, victim)))) then
      victim, victim_n, victim_w = other, n, w
    end
  end
end
if excess > 0 and victim and victim_n >= own + 2 then
  victim_id = rcall('LINDEX', tq_key(P, model, cls, victim), '-1')
  victim_cost = tonum(rcall('HGET', job_key(P, victim_id), 'cost'))
  evict = over(model_max_jobs, model_max_tokens, model_jobs - 1, model_tokens - victim_cost) <= 0
    and over(class_max_jobs, class_max_tokens, class_jobs - 1, class_tokens - victim_cost) <= 0
end

local wait = ahead_tokens / rate -- DrainRate.wait_s
-- DrainRate.batch_rate, what the Retry-After book spreads its times over, and
-- promise_rate_behind(ahead_jobs), what the deadline check promises this job's wait at
local batch_rate, promise_rate = rate, rate
if samples > 0 then
  local spread = time_spread(per_slot, slow, samples)
  local slowdown_promised = promise_slowdown(fill_numbers, slowdown, max_slowdown, extrapolation, spread,
    gap_share, gap_sd)
  batch_rate = math.max(per_slot / slowdown_promised * math.max(slots, 1), 1e-3)
  local residual = residual_spread(tonum(d[7]), tonum(d[8]), spread)
  promise_rate = math.max(batch_rate / wait_margin(spread, samples, slots, drain_alpha, per_slot_weight,
    margin_z, ahead_jobs, residual), 1e-3)
end
local service = cost / math.max(slot_rate, 1e-3) -- DrainRate.service_s
-- DrainRate.slow_service_s: behind a queue at the full batch's pace, alone (nothing queued ahead)
-- at the pace measured, which is also what "never fits" is judged by
local promised, alone = service, service
if samples > 0 then
  alone = math.max(cost * slow, cost / math.max(per_slot, 1e-3))
  promised = alone
  if ahead_tokens > 0 then promised = math.max(cost * slow * slowdown, cost * slowdown / math.max(per_slot, 1e-3)) end
end
local running = 0 -- only cap counts the running jobs
if policy_kind == 1 then running = (rcall('HGET', running_k, model) or 0) * 1 end
-- The order of the memory broker: the tenant's limits, the hard bounds, then the policy; every
-- refusal that says to retry reserves (policy.decide, admission.reserve).
local refused = false
local next_free = st_num(st, 'rv', nil)
local retry_after, retry = nil, true
local tenant_wait = math.max(wait_r, wait_t) -- TenantLimiter.check: the longer wait decides
if tenant_wait > 0 then -- admission.check_tenant
  if tenant_wait == math.huge then
    retry_after, retry = retry_bounds[2], false -- more than the key's tokens per minute: no retry
  else
    retry_after = clamp_retry_after(tenant_wait, retry_bounds)
  end
elseif mq and queued_by_tenant >= mq then
  retry_after = clamp_retry_after(cost / rate, retry_bounds) -- drain.wait_s(cost)
elseif excess > 0 and not evict then
  retry_after = clamp_retry_after(excess / rate, retry_bounds)
else
  retry_after, retry = policy_refuses(st, policy_kind, policy, now, now_s, {
    running = running, model_jobs = model_jobs, model_tokens = model_tokens, slots = slots,
    wait = wait, wait_model = runnable_tokens / rate, wait_one = cost / rate, service = service,
    promised = promised, alone = alone,
    budget = deadline - now, measured = samples > 0, samples = samples, rate = rate,
    ahead_tokens = ahead_tokens,
    promise_rate = promise_rate,
    R = retry_bounds,
  })
end
if retry_after then
  refused = true
  if retry then
    local at = now + retry_after
    if next_free and next_free > at then at = next_free end
    if at - now <= patience or samples == 0 then st_set(st, 'rv', num(at + cost / (batch_rate * share))) end
  end
end
if refused then
  tenant_store(rl, rs, tl, ts) -- the refills stand
  wake_if_cap_freed(queued_by_tenant) -- the key's cap stands too
  st_flush(st) -- the policy's state and the reservations moved on
  local out = { 0, model_jobs, model_tokens, class_jobs, class_tokens, ahead_jobs, ahead_tokens, runnable_tokens,
    num(per_slot), samples, slots }
  for _, v in ipairs(tenant_state(old_rl, old_rs, old_tl, old_ts)) do out[#out + 1] = v end
  out[#out + 1] = running
  for _, v in ipairs(policy_before) do out[#out + 1] = v end
  out[#out + 1] = victim_cost or ''
  out[#out + 1] = next_free and num(next_free) or ''
  out[#out + 1] = num(slow)
  out[#out + 1] = fill
  out[#out + 1] = d[7] or '' -- DrainRate.resid
  out[#out + 1] = d[8] or '' -- DrainRate.service
  return out
end

if evict then -- MemoryBroker._evict
  local vk = job_key(P, victim_id)
  local vf = job_read(vk)
  fq_remove(st, cls, tq_key(P, model, cls, victim), victim_id, victim_cost)
  rcall('ZREM', deadline_k, victim_id)
  settle(victim_id, vf, 'failed', { 'error', evicted_error })
end

-- TenantLimiter.take, and one more job queued for the tenant.
if rpm then rl = rl - 1 end
if tpm then tl = tl - cost end
queued_by_tenant = queued_by_tenant + 1
tenant_store(rl, rs, tl, ts)

local wait_text = num(wait) -- in the record and in the reply: made once (~6 k instructions)

-- Event 1 (QUEUED) lives in the record, field 'q': a stream costs 4 KB from its first entry
-- (stream-node-max-bytes is preallocated), and most of a backlog never gets further than this.
-- 'kb' names the buckets the job was charged to, which finish settles.
do
  local record = { 'state', 'queued', 'seq', '1',
    'q', '{"position":' .. ahead_jobs .. ',"estimated_start_s":' .. wait_text .. '}' }
  if limits_given then
    table.insert(record, 'kb')
    table.insert(record, bucket)
  end
  for i = RECORD_AT, #ARGV do record[#record + 1] = ARGV[i] end
  rcall('HSET', job_k, unpack(record))
  fq_push(st, cls, sched_k, tq_k, tenant, id, cost, false)
  -- the same head and tag, one job more: what head_of stored holds on (an empty list's new head
  -- is stored by the next admission that reads it)
  local tag = st.v[own_t]
  if own_head and tag then st_set(st, own_h, own_head .. int_text(own + 1) .. ':' .. tag) end
end
st_flush(st)
rcall('ZADD', deadline_k, ARGV[5], id, 'inf', SKIPLIST_MEMBER) -- the deadline's text: not formatted again
if KEYS[18] and ARGV[15] ~= '' then -- as RedisJobs._list_job: NX sets a first expiry, GT lengthens
  rcall('ZADD', KEYS[18], ARGV[14], id)
  rcall('PEXPIRE', KEYS[18], ARGV[15], 'NX')
  rcall('PEXPIRE', KEYS[18], ARGV[15], 'GT')
elseif KEYS[18] then -- listed by the caller, or by upkeep if the caller cannot
  rcall('ZADD', KEYS[18], now_s, id)
end
if idem_ttl > 0 then
  rcall('SET', idem_k, id .. ' ' .. num(now + idem_ttl), 'PX', math.ceil(idem_ttl * 1000))
end
if model_jobs == 0 then
  -- While the model has queued work, every claim that leaves some behind sets the marker again
  -- (claim.lua), so only the first job of an idle queue needs to wake a claimer.
  rcall('SADD', models_k, model)
  rcall('ZADD', marker_k, '0', 'w')
elseif held_jobs >= model_jobs - (evict and 1 or 0) and not (mc and running_by_tenant >= mc) then
  -- Every job queued before (but an evicted one) was held back by its tenant's cap: the claims
  -- they woke found nothing to take and wait again, and claim.lua set no marker for them; this
  -- job, which a claim can take, wakes one (the memory broker wakes every claim on every
  -- admission). Only an admission while a capped tenant holds jobs back gets here.
  rcall('ZADD', marker_k, '0', 'w')
end
wake_if_cap_freed(queued_by_tenant - 1)
local out = { 1, ahead_jobs, wait_text }
for _, v in ipairs(tenant_state(rl, rs, tl, ts)) do out[#out + 1] = v end
return out
