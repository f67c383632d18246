-- Admit one request of a dataset, or say why not.
-- The rule (REFERENCE §6): admit while
--   committed + sum over in-flight of E[final size | size so far] + E[size of this one]
--   + margin_sd * sd(of that sum) <= budget,
-- and also whenever nothing is in flight and committed < budget, so a dataset never
-- stops short of its budget while prompts remain (it may end above by about one response).
-- KEYS[1] closed flag  KEYS[2] done hash  KEYS[3] inflight hash  KEYS[4] stats hash
-- KEYS[5] budgets hash KEYS[6] model string (JSON, see ledger.py)
-- ARGV[1] dataset  ARGV[2] sample id  ARGV[3] in-flight entry (JSON, has rid)
-- ARGV[4] now (s)  ARGV[5] default budget  ARGV[6] prompt tokens of this request
-- ARGV[7] measure ("completion" | "total")  ARGV[8] precise admission (1) or naive (0)
-- ARGV[9] prior tokens per second of one request (until the model has a measured rate)
-- ARGV[10] margin in standard deviations of the in-flight total (admission_margin_sd)
-- Returns {status, committed, expected in flight}: status is
--   "ok" | "closed" | "done" | "busy" (in flight elsewhere) | "wait" (no room yet)
local sample = ARGV[2]
if redis.call('EXISTS', KEYS[1]) == 1 then return {'closed', 0, 0} end
if redis.call('HEXISTS', KEYS[2], sample) == 1 then return {'done', 0, 0} end
if redis.call('HEXISTS', KEYS[3], sample) == 1 then return {'busy', 0, 0} end

local committed = tonumber(redis.call('HGET', KEYS[4], 'tokens') or '0')
local budget = tonumber(redis.call('HGET', KEYS[5], ARGV[1]) or ARGV[5])
if committed >= budget then
  redis.call('SET', KEYS[1], 'budget')
  return {'closed', committed, 0}
end

local now = tonumber(ARGV[4])
local total = ARGV[7] == 'total'
local prior = tonumber(ARGV[9])
local raw_model = redis.call('GET', KEYS[6])
local model = nil
if raw_model then model = cjson.decode(raw_model) end

-- E[L | L > p] from the model's table of thresholds and conditional means; until the
-- model exists, the request's cap (max_new_tokens): slow to start, never an overshoot.
local function expected_final(p, cap)
  if not model then return cap end
  local t, m = model['t'], model['m']
  local lo, hi = 1, #t
  if p < t[1] then return math.max(m[1], p) end
  if p >= t[hi] then return p + model['tail'] end
  while hi - lo > 1 do
    local mid = math.floor((lo + hi) / 2)
    if t[mid] <= p then lo = mid else hi = mid end
  end
  -- E[L | L > t] grows with t: interpolate rather than take the lower threshold's value.
  local w = (p - t[lo]) / math.max(1, t[hi] - t[lo])
  return math.max(m[lo] + w * (m[hi] - m[lo]), p)
end

-- Var[L | L > p], same table; zero without a model (the cap is already the worst case).
local function variance(p)
  if not model or not model['v'] then return 0 end
  local t, v = model['t'], model['v']
  local lo, hi = 1, #t
  if p >= t[hi] then return v[hi] end
  while hi - lo > 1 do
    local mid = math.floor((lo + hi) / 2)
    if t[mid] <= p then lo = mid else hi = mid end
  end
  return v[lo]
end

local rate = prior
if model then rate = model['rate'] end
local mean = prior
if model then mean = model['mean'] end

local expected = 0
local var = 0
local entries = redis.call('HVALS', KEYS[3])
if ARGV[8] == '1' then
  for _, raw in ipairs(entries) do
    local e = cjson.decode(raw)
    local p = math.max(0, now - e['start']) * rate
    if e['max_new_tokens'] then p = math.min(p, e['max_new_tokens']) end
    local cap = e['max_new_tokens'] or prior
    local final = math.min(expected_final(p, cap), cap)
    var = var + variance(p)
    if total then final = final + (e['prompt_tokens'] or 0) end
    expected = expected + final
  end
end
local this_one = mean
if not model then this_one = cjson.decode(ARGV[3])['max_new_tokens'] or prior end
if model and model['var'] then var = var + model['var'] end
local margin = (tonumber(ARGV[10]) or 0) * math.sqrt(var)
if total then this_one = this_one + tonumber(ARGV[6]) end

if ARGV[8] == '1' and #entries > 0 and committed + expected + this_one + margin > budget then
  return {'wait', committed, math.floor(expected)}
end
redis.call('HSET', KEYS[3], sample, ARGV[3])
-- The largest max_new_tokens seen bounds the length model's tail.
local this_cap = cjson.decode(ARGV[3])['max_new_tokens'] or 0
if this_cap > tonumber(redis.call('HGET', KEYS[4], 'cap') or '0') then
  redis.call('HSET', KEYS[4], 'cap', this_cap)
end
return {'ok', committed, math.floor(expected)}
