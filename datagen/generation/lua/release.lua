-- Release one in-flight request that did not end in a commit (failure, abort, hand-back),
-- atomically: only the rid that holds the sample can drop it. A freed slot wakes parked
-- samples of the dataset, which may now fit in its budget.
-- KEYS[1] flight  KEYS[2] buckets  KEYS[3] leases  KEYS[4] parked  KEYS[5] pending
-- KEYS[6] closed flag
-- ARGV[1] sample  ARGV[2] rid  ARGV[3] how many parked samples to wake
-- Returns {released 0/1, payload, payload, ...}
local released = release_own(KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[2])
if not released then return {0} end
local out = {1}
if redis.call('EXISTS', KEYS[6]) == 0 then
  for _, p in ipairs(wake(KEYS[4], KEYS[5], tonumber(ARGV[3]))) do out[#out + 1] = p end
end
return out
