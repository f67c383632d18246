-- Release one in-flight request that did not end in a commit (failure, abort, hand-back),
-- atomically: only the rid that holds the sample can drop it. The freed room wakes as many
-- parked samples of the dataset as now fit in its budget.
-- KEYS[1] flight  KEYS[2] buckets  KEYS[3] leases  KEYS[4] parked  KEYS[5] pending
-- KEYS[6] closed flag  KEYS[7] stats  KEYS[8] budgets  KEYS[9] model
-- ARGV[1] sample  ARGV[2] rid  ARGV[3] most parked samples to wake  ARGV[4] dataset
-- ARGV[5] default budget  ARGV[6] prior tokens per second  ARGV[7] prior mean length
-- ARGV[8] measure  ARGV[9] margin in sd  ARGV[10] precise (1) or naive (0)
-- Returns {released 0/1, payload, payload, ...}
local released = release_own(KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[2])
if not released then return {0} end
local out = {1}
if redis.call('EXISTS', KEYS[6]) == 0 and redis.call('ZCARD', KEYS[4]) > 0 then
  local est = in_flight_estimate(KEYS[2], KEYS[9], redis_now(), tonumber(ARGV[6]),
                                 tonumber(ARGV[7]), ARGV[8] == 'total', ARGV[10] == '1')
  local committed = tonumber(redis.call('HGET', KEYS[7], 'tokens') or '0')
  local budget = tonumber(redis.call('HGET', KEYS[8], ARGV[4]) or ARGV[5])
  local n = fits(est, committed, budget, tonumber(ARGV[9]), tonumber(ARGV[3]),
                 tonumber(redis.call('HGET', KEYS[7], 'cap') or '0'))
  for _, p in ipairs(wake(KEYS[4], KEYS[5], n)) do out[#out + 1] = p end
end
return out
