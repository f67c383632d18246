-- Shared by every ledger script (prepended when the script is registered).
-- In-flight requests live in three structures kept in step by drop_entry/add_entry:
--   flight  HASH sample -> JSON entry {rid, worker, server, start, max_new_tokens,
--           prompt_tokens, b}, b = the bucket field the entry is counted in;
--   buckets HASH "<start bucket>:<cap>" -> count, and "_prompt" -> prompt tokens in flight
--           (what admission reads: O(buckets), never O(in flight));
--   leases  ZSET sample -> lease deadline (Redis time, s), renewed by the owner's heartbeat.

local function redis_now()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end

local function drop_entry(flight, buckets, leases, sample, raw)
  local e = cjson.decode(raw)
  if e['b'] then
    if redis.call('HINCRBY', buckets, e['b'], -1) <= 0 then
      redis.call('HDEL', buckets, e['b'])
    end
    redis.call('HINCRBY', buckets, '_prompt', -(e['prompt_tokens'] or 0))
  end
  redis.call('HDEL', flight, sample)
  redis.call('ZREM', leases, sample)
end

-- Drop the sample's entry only when it is still this rid's (compare-and-delete).
local function release_own(flight, buckets, leases, sample, rid)
  local raw = redis.call('HGET', flight, sample)
  if raw and cjson.decode(raw)['rid'] == rid then
    drop_entry(flight, buckets, leases, sample, raw)
    return true
  end
  return false
end

-- Pop up to n parked samples (oldest first) and return their task payloads, so the
-- caller enqueues them again; payloads already gone (done, closed) are skipped.
local function wake(parked, pending, n)
  local out = {}
  if n <= 0 then return out end
  local popped = redis.call('ZPOPMIN', parked, n)
  for i = 1, #popped, 2 do
    local payload = redis.call('HGET', pending, popped[i])
    if payload then out[#out + 1] = payload end
  end
  return out
end

-- Admission's view of a dataset's requests in flight: E[what they will count] and its
-- variance, from the (start, cap) buckets and the length model (t/m/v table, see
-- admission.py). Until the model exists each request counts at its cap.
--   est = {expected, var, count, mean, rate, model, worst}; var includes the next request's
--   own; worst is what they count at the most (every one at its cap).
local function locate(t, p)
  local lo, hi = 1, #t
  while hi - lo > 1 do
    local mid = math.floor((lo + hi) / 2)
    if t[mid] <= p then lo = mid else hi = mid end
  end
  return lo, hi
end

local function expected_final(model, p, cap)
  if not model then return cap, 0 end
  local t, m, v = model['t'], model['m'], model['v']
  if p < t[1] then return math.max(m[1], p), v[1] end
  if p >= t[#t] then return p + model['tail'], v[#t] end
  local lo, hi = locate(t, p)
  -- E[L | L > t] grows with t: interpolate rather than take the lower threshold's value.
  local w = (p - t[lo]) / math.max(1, t[hi] - t[lo])
  return math.max(m[lo] + w * (m[hi] - m[lo]), p), v[lo]
end

local function in_flight_estimate(buckets, model_key, now, prior_rate, prior_mean, total,
                                  precise)
  local raw = redis.call('GET', model_key)
  local model = nil
  if raw then model = cjson.decode(raw) end
  local rate, mean = prior_rate, prior_mean
  if model then rate, mean = model['rate'], model['mean'] end
  local expected, var, count, worst = 0, 0, 0, 0
  local flat = redis.call('HGETALL', buckets)
  for i = 1, #flat, 2 do
    local field = flat[i]
    if field ~= '_prompt' then
      local n = tonumber(flat[i + 1])
      local colon = string.find(field, ':', 1, true)
      local start = tonumber(string.sub(field, 1, colon - 1))
      local cap = tonumber(string.sub(field, colon + 1))
      count = count + n
      worst = worst + n * cap
      if precise and n > 0 then
        -- The bucket's start is its earliest: the most progress, the largest E[L | L > p].
        local p = math.min(math.max(0, now - start) * rate, cap)
        local final, v = expected_final(model, p, cap)
        expected = expected + n * math.min(final, cap)
        var = var + n * v
      end
    elseif total then
      expected = expected + tonumber(flat[i + 1])
      worst = worst + tonumber(flat[i + 1])
    end
  end
  if model and model['var'] then var = var + model['var'] end
  return {expected = expected, var = var, count = count, mean = mean, rate = rate,
          model = model, worst = worst}
end

-- How many more requests fit now: room / E[one more] (the largest cap seen, until the
-- model exists), or as many as fit at their caps if that is more; at most `most`; one
-- when nothing is in flight (admission admits then).
local function fits(est, committed, budget, margin_sd, most, cap_seen)
  if est.count == 0 then return math.min(1, most) end
  local one = est.mean
  if not est.model then one = cap_seen end
  local room = budget - committed - est.expected - margin_sd * math.sqrt(est.var)
  local n = 0
  if room > 0 then n = math.floor(room / math.max(1, one)) end
  local at_caps = math.floor((budget - committed - est.worst) / math.max(1, cap_seen))
  return math.max(0, math.min(most, math.max(n, at_caps)))
end

-- After a commit or release: wake as many parked samples as fit in the budget now
-- (admission decides again when they run; a woken sample refused again costs a task run
-- for nothing), appending their payloads to out.
--   k = {closed, parked, pending, buckets, model, stats, budgets}
--   a = {dataset, default budget, prior rate, prior mean, total?, margin sd, precise?, most}
local function wake_into_room(k, a, out)
  if redis.call('EXISTS', k.closed) == 1 or redis.call('ZCARD', k.parked) == 0 then
    return out
  end
  local est = in_flight_estimate(k.buckets, k.model, redis_now(), a.rate, a.mean, a.total,
                                 a.precise)
  local committed = tonumber(redis.call('HGET', k.stats, 'tokens') or '0')
  local budget = tonumber(redis.call('HGET', k.budgets, a.dataset) or a.budget)
  local cap_seen = tonumber(redis.call('HGET', k.stats, 'cap') or '0')
  local n = fits(est, committed, budget, a.margin, a.most, cap_seen)
  for _, p in ipairs(wake(k.parked, k.pending, n)) do out[#out + 1] = p end
  return out
end
