-- Shared: the choice between the priority classes of one model, a mirror of
-- sluice.core.scheduler.ClassScheduler: strict priority, with credits for the minimum shares.
-- While classes compete, every waiting class that is not served earns its minimum share in
-- credit; a lower class holding a whole credit is served next (the richest first) and pays one.
-- A class "waits" when it has a job of a tenant not at its concurrency cap (has_eligible).
-- eligible, counts, credits, mins: arrays by class index, highest class first.

-- ClassScheduler.next_class: the class index to serve, or nil when no class can be served.
local function next_class(eligible, credits)
  local first, due = nil, nil
  for i = 1, #eligible do
    if eligible[i] then
      if first == nil then
        first = i
      elseif credits[i] >= 1.0 and (due == nil or credits[i] > credits[due]) then
        due = i
      end
    end
  end
  return due or first
end

-- The credit bookkeeping of ClassScheduler.pop after class `served` gave up one job: eligible is
-- as it was before, counts are the queue lengths after. Returns the new credits.
local function pay_credits(eligible, counts, credits, mins, served)
  local out = {}
  for i = 1, #eligible do out[i] = credits[i] end
  if out[served] >= 1.0 then out[served] = out[served] - 1.0 end
  for i = 1, #eligible do
    if eligible[i] and i ~= served then out[i] = out[i] + mins[i] end
  end
  for i = 1, #eligible do
    if counts[i] <= 0 then out[i] = 0.0 end
  end
  return out
end
