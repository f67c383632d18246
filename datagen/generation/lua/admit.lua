-- Admit one request of a dataset, or say why not; a refused sample is parked.
-- The rule: admit while
--   committed + sum over in-flight of E[final size | size so far] + E[size of this one]
--   + margin_sd * sd(of that sum) <= budget,
-- and also whenever nothing is in flight and committed < budget, so a dataset never
-- stops short of its budget while prompts remain (it may end above by about one response),
-- and whenever the worst case fits: committed + every request in flight and this one at
-- its cap <= budget (nothing admitted so can end past the budget; a small budget does not
-- wait on an early length model that is mostly prior).
-- In-flight requests are read as buckets of (start time, cap class) with their counts and
-- cap sums, so the cost grows with the buckets (about 64, whatever the caps), not with the
-- requests in flight.
-- Time is Redis's (TIME), the same for every host.
-- KEYS[1] run marker  KEYS[2] closed flag  KEYS[3] done hash  KEYS[4] flight hash
-- KEYS[5] stats hash  KEYS[6] budgets hash  KEYS[7] model string (JSON, see admission.py)
-- KEYS[8] buckets hash  KEYS[9] leases zset  KEYS[10] parked zset
-- ARGV[1] dataset  ARGV[2] sample  ARGV[3] rid  ARGV[4] worker (owner id)  ARGV[5] server
-- ARGV[6] prompt tokens  ARGV[7] max_new_tokens (at most what it can count: with the measure
-- "trainable", what the window leaves)  ARGV[8] measure ("trainable" | "completion" | "total")
-- ARGV[9] precise admission (1) or naive (0)  ARGV[10] prior tokens per second of a request
-- ARGV[11] margin in standard deviations (admission_margin_sd)  ARGV[12] default budget
-- ARGV[13] lease seconds  ARGV[14] prior mean response length
-- Returns {status, committed, expected in flight, closed now 0/1}; status is
--   "ok" | "closed" | "done" | "busy" (held elsewhere under a live lease) |
--   "wait" (no room yet: parked until a commit or release wakes it) |
--   "lost" (no run marker: the ledger lost its state and must be rebuilt first)
local sample = ARGV[2]
local now = redis_now()
if redis.call('EXISTS', KEYS[1]) == 0 then return {'lost', 0, 0, 0} end
if redis.call('EXISTS', KEYS[2]) == 1 then return {'closed', 0, 0, 0} end
if redis.call('HEXISTS', KEYS[3], sample) == 1 then return {'done', 0, 0, 0} end
local held = redis.call('HGET', KEYS[4], sample)
if held then
  local lease = tonumber(redis.call('ZSCORE', KEYS[9], sample) or '0')
  if lease >= now and cjson.decode(held)['worker'] ~= ARGV[4] then
    return {'busy', 0, 0, 0}
  end
  -- Its owner stopped renewing (dead, restarted, or its release was lost), or it is this
  -- owner's own earlier try whose release has not reached Redis yet: take it over.
  drop_entry(KEYS[4], KEYS[8], KEYS[9], sample, held)
end

local committed = tonumber(redis.call('HGET', KEYS[5], 'tokens') or '0')
local budget = tonumber(redis.call('HGET', KEYS[6], ARGV[1]) or ARGV[12])
if committed >= budget then
  local closed_now = 0
  if redis.call('SET', KEYS[2], 'budget', 'NX') then closed_now = 1 end
  redis.call('DEL', KEYS[10])
  return {'closed', committed, 0, closed_now}
end

local total = ARGV[8] == 'total'
local cap_here = tonumber(ARGV[7])
local est = in_flight_estimate(KEYS[8], KEYS[7], now, tonumber(ARGV[10]), tonumber(ARGV[14]),
                               total, ARGV[9] == '1')
local rate, model, expected = est.rate, est.model, est.expected
-- E[L] of a fresh request, at most its own cap (the model may come from larger caps).
local this_one = math.min(est.mean, cap_here)
if not model then this_one = cap_here end
local margin = (tonumber(ARGV[11]) or 0) * math.sqrt(est.var)
if total then this_one = this_one + tonumber(ARGV[6]) end

local at_caps = committed + est.worst + cap_here
if total then at_caps = at_caps + tonumber(ARGV[6]) end
if ARGV[9] == '1' and est.count > 0 and committed + expected + this_one + margin > budget
    and at_caps > budget then
  redis.call('ZADD', KEYS[10], 'NX', now, sample)
  return {'wait', committed, math.floor(expected), 0}
end

-- The largest max_new_tokens seen sets the buckets' time grid and bounds the length
-- model's tail.
local cap_max = tonumber(redis.call('HGET', KEYS[5], 'cap') or '0')
if cap_here > cap_max then
  redis.call('HSET', KEYS[5], 'cap', cap_here)
  cap_max = cap_here
end
local bucket = bucket_field(now, cap_here, cap_max, rate)
redis.call('HSET', KEYS[4], sample, cjson.encode({
  rid = ARGV[3], worker = ARGV[4], server = ARGV[5], start = now,
  max_new_tokens = cap_here, prompt_tokens = tonumber(ARGV[6]), b = bucket}))
count_entry(KEYS[8], bucket, cap_here, tonumber(ARGV[6]))
redis.call('ZADD', KEYS[9], now + tonumber(ARGV[13]), sample)
redis.call('ZREM', KEYS[10], sample)
return {'ok', committed, math.floor(expected), 0}
