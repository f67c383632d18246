-- Shared by every ledger script (prepended when the script is registered).
-- In-flight requests live in three structures kept in step by drop_entry/count_entry:
--   flight  HASH sample -> JSON entry {rid, worker, server, start, max_new_tokens,
--           prompt_tokens, b}, b = the bucket field the entry is counted in;
--   buckets HASH of (start bucket, cap class) buckets, what admission reads: O(buckets),
--           never O(in flight), and bounded whatever the caps (see bucket_field):
--             "<start * 64 + class>" -> requests in it, "c<same>" -> the sum of their caps,
--             "_prompt" -> prompt tokens in flight;
--   leases  ZSET sample -> lease deadline (Redis time, s), renewed by the owner's heartbeat.

local function redis_now()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end

-- Cap classes are octaves of max_new_tokens (class k: caps in [2^k, 2^(k + 1))), so a
-- dataset whose long prompts each get their own cap (context - prompt - 1) still has a
-- dozen classes at most, not a bucket per request. A bucket keeps the sum of its caps too:
-- its requests count min(n * E[L | L > p], sum of caps), exactly what n requests of one cap
-- count, and never less than its requests of different caps would each.
local CLASSES = 64

local function cap_class(cap)
  local _, e = math.frexp(math.max(1, cap))
  return math.min(CLASSES - 1, e - 1)
end

-- The bucket field of a request starting now: digits only, so a reader decodes it with
-- one tonumber. Every class shares one time grid, the expected duration of the dataset's
-- largest cap / 32 (1-60 s): a few dozen buckets for the largest class, fewer for each
-- smaller one (its requests end sooner), so about 64 in all whatever the caps.
local function bucket_field(now, cap, cap_max, rate)
  local width = math.max(1, math.min(60, math.floor(cap_max / math.max(rate, 1e-3) / 32)))
  return string.format('%d', math.floor(now / width) * width * CLASSES + cap_class(cap))
end

local function count_entry(buckets, field, cap, prompt_tokens)
  redis.call('HINCRBY', buckets, field, 1)
  redis.call('HINCRBY', buckets, 'c' .. field, cap)
  redis.call('HINCRBY', buckets, '_prompt', prompt_tokens)
end

local function drop_entry(flight, buckets, leases, sample, raw)
  local e = cjson.decode(raw)
  local b = e['b']
  if b then
    -- (A "<start>:<cap>" field is an entry admitted before cap classes: no cap sum.)
    local legacy = string.find(b, ':', 1, true)
    if redis.call('HINCRBY', buckets, b, -1) <= 0 then
      redis.call('HDEL', buckets, b, 'c' .. b)
    elseif not legacy then
      redis.call('HINCRBY', buckets, 'c' .. b, -(e['max_new_tokens'] or 0))
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

-- The buckets as {start, count, sum of caps} rows, and the prompt tokens in flight.
local function read_buckets(buckets)
  local flat = redis.call('HGETALL', buckets)
  local caps, rows, prompt = {}, {}, 0
  for i = 1, #flat, 2 do
    if string.byte(flat[i], 1) == 99 then caps[string.sub(flat[i], 2)] = tonumber(flat[i + 1]) end
  end
  for i = 1, #flat, 2 do
    local field = flat[i]
    local x = tonumber(field)
    if x then
      local n = tonumber(flat[i + 1])
      rows[#rows + 1] = {(x - x % CLASSES) / CLASSES, n, caps[field] or 0}
    elseif field == '_prompt' then
      prompt = tonumber(flat[i + 1])
    elseif string.byte(field, 1) ~= 99 then
      local colon = string.find(field, ':', 1, true)
      if colon then  -- "<start>:<cap>", from before cap classes
        local n = tonumber(flat[i + 1])
        rows[#rows + 1] = {tonumber(string.sub(field, 1, colon - 1)), n,
                           n * tonumber(string.sub(field, colon + 1))}
      end
    end
  end
  return rows, prompt
end

local function in_flight_estimate(buckets, model_key, now, prior_rate, prior_mean, total,
                                  precise)
  local raw = redis.call('GET', model_key)
  local model = nil
  if raw then model = cjson.decode(raw) end
  local rate, mean = prior_rate, prior_mean
  if model then rate, mean = model['rate'], model['mean'] end
  local expected, var, count, worst = 0, 0, 0, 0
  local rows, prompt = read_buckets(buckets)
  local at = {}  -- E[L | L > p] and its variance by bucket start: one lookup per start
  for _, row in ipairs(rows) do
    local start, n, caps = row[1], row[2], row[3]
    count = count + n
    worst = worst + caps
    if precise and n > 0 then
      if not model then
        expected = expected + caps
      else
        -- The bucket's start is its earliest: the most progress, the largest E[L | L > p].
        -- min(E[L | L > p], cap) is what each request counts (E[L | L > p] >= p, so one past
        -- its cap counts its cap), and n of them never count more than the sum of their caps.
        local p = math.max(0, now - start) * rate
        local hit = at[start]
        if not hit then
          local final, v = expected_final(model, p, nil)
          hit = {final, v}
          at[start] = hit
        end
        expected = expected + math.min(n * hit[1], caps)
        local v = hit[2]
        if p > caps / n then v = select(2, expected_final(model, caps / n, nil)) end
        var = var + n * v
      end
    end
  end
  if total then
    expected = expected + prompt
    worst = worst + prompt
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
