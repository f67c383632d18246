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
return wake_into_room(
  {closed = KEYS[6], parked = KEYS[4], pending = KEYS[5], buckets = KEYS[2], model = KEYS[9],
   stats = KEYS[7], budgets = KEYS[8]},
  {dataset = ARGV[4], budget = ARGV[5], rate = tonumber(ARGV[6]), mean = tonumber(ARGV[7]),
   total = ARGV[8] == 'total', margin = tonumber(ARGV[9]), precise = ARGV[10] == '1',
   most = tonumber(ARGV[3])}, {1})
