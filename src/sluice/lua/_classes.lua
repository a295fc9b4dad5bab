-- Shared: the choice between the priority classes of one model, a mirror of
-- sluice.core.scheduler.ClassScheduler: strict priority, with credits for the minimum shares.
-- While classes compete, every waiting class that is not served earns its minimum share in
-- credit; a lower class holding a whole credit is served next (the richest first) and pays one.
-- counts, credits, mins: arrays by class index, highest class first.

-- ClassScheduler.next_class: the class index to serve, or nil when no class has work.
local function next_class(counts, credits)
  local first, due = nil, nil
  for i = 1, #counts do
    if counts[i] > 0 then
      if first == nil then
        first = i
      elseif credits[i] >= 1.0 and (due == nil or credits[i] > credits[due]) then
        due = i
      end
    end
  end
  return due or first
end

-- The credit bookkeeping of ClassScheduler.pop after class `served` gave up one job; counts are
-- the queue lengths before that job left. Returns the new credits.
local function pay_credits(counts, credits, mins, served)
  local out = {}
  for i = 1, #counts do out[i] = credits[i] end
  if out[served] >= 1.0 then out[served] = out[served] - 1.0 end
  for i = 1, #counts do
    if counts[i] > 0 and i ~= served then out[i] = out[i] + mins[i] end
  end
  for i = 1, #counts do
    local left = counts[i]
    if i == served then left = left - 1 end
    if left <= 0 then out[i] = 0.0 end
  end
  return out
end
