-- Shared by every ledger script (prepended when the script is registered).
-- In-flight requests live in three structures kept in step by count_entry/drop_entry:
--   flight  HASH sample -> JSON entry {rid, worker, server, start, max_new_tokens,
--           prompt_tokens, b}, b = the bucket field the entry is counted in;
--   buckets HASH "<start * 64 + cap class>" -> "<sum of the caps * 2^24 + requests>" (see
--           bucket_field and unpack_bucket), "_prompt" -> prompt tokens in flight: what
--           admission reads, O(buckets), never O(in flight), and bounded whatever the caps;
--   leases  ZSET sample -> lease deadline (Redis time, s), renewed by the owner's heartbeat.

local floor, min, max = math.floor, math.min, math.max

local function redis_now()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end

-- Cap classes are double octaves of max_new_tokens (class k: caps in [4^k, 4^(k + 1))), so
-- a dataset whose long prompts each get their own cap (context - prompt - 1) has half a dozen
-- classes at most, not a bucket per request, and admission reads half the fields octaves
-- would give. A bucket keeps the sum of its caps with its count: its requests count
-- min(n * E[L | L > p], sum of caps), what n requests of one cap count exactly, and never
-- less than requests of different caps count each.
local CLASSES = 64
local COUNT = 16777216  -- 2^24: a bucket's value is sum of caps * COUNT + requests

local function cap_class(cap)
  local _, e = math.frexp(max(1, cap))
  return min(CLASSES - 1, floor((e - 1) / 2))
end

-- The bucket field of a request starting now. Every class shares one time grid, the
-- expected duration of the dataset's largest cap / 32 (1-60 s): a few dozen buckets for the
-- largest class, a quarter as many for the next (its requests end sooner), and so on: about
-- 45 in all whatever the caps. One cap (or one per queue) reads as the buckets did before
-- cap classes: the same grid, one class each.
local function bucket_field(now, cap, cap_max, rate)
  local width = max(1, min(60, floor(cap_max / max(rate, 1e-3) / 32)))
  return string.format('%d', floor(now / width) * width * CLASSES + cap_class(cap))
end

-- A bucket's value as (requests, sum of their caps). Below 2^53 a double holds it exactly and
-- the split by a power of two is exact; past it (over 2^29 tokens of caps in one bucket) the
-- low digits are read apart so the count stays exact.
local function unpack_bucket(raw)
  local v = tonumber(raw)
  if v < 9007199254740992 then
    local n = v % COUNT
    return n, (v - n) / COUNT
  end
  local hi, lo = tonumber(string.sub(raw, 1, -7)), tonumber(string.sub(raw, -6))
  local n = ((hi % COUNT) * 1000000 + lo) % COUNT
  return n, (hi * 1000000 + lo - n) / COUNT
end

local function count_entry(buckets, field, cap, prompt_tokens)
  redis.call('HINCRBY', buckets, field, cap * COUNT + 1)
  redis.call('HINCRBY', buckets, '_prompt', prompt_tokens)
end

local function drop_entry(flight, buckets, leases, sample, raw)
  local e = cjson.decode(raw)
  local b = e['b']
  if b then
    -- A "<start>:<cap>" field counts entries admitted before cap classes, one each.
    local one = 1
    if not string.find(b, ':', 1, true) then one = (e['max_new_tokens'] or 0) * COUNT + 1 end
    if redis.call('HINCRBY', buckets, b, -one) <= 0 then redis.call('HDEL', buckets, b) end
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

-- The length model (admission.py's encode_model: MessagePack, whose doubles decode in
-- about half cjson's time; a JSON model from before is read too). nil until it exists.
local function read_model(key)
  local raw = redis.call('GET', key)
  if not raw then return nil end
  if string.byte(raw, 1) == 123 then return cjson.decode(raw) end  -- '{'
  return cmsgpack.unpack(raw)
end

-- The buckets as parallel lists (start, class, requests, sum of caps), empty ones left out,
-- with the prompt tokens in flight.
local function read_buckets(buckets)
  local starts, classes, ns, caps = {}, {}, {}, {}
  local k, prompt = 0, 0
  local flat = redis.call('HGETALL', buckets)
  for i = 1, #flat, 2 do
    local x = tonumber(flat[i])
    local start, class, n, c
    if x then
      class = x % CLASSES
      start = (x - class) / CLASSES
      n, c = unpack_bucket(flat[i + 1])
    elseif flat[i] == '_prompt' then
      prompt = tonumber(flat[i + 1])
    else  -- "<start>:<cap>", from before cap classes
      local colon = string.find(flat[i], ':', 1, true)
      local cap = tonumber(string.sub(flat[i], colon + 1))
      start, class = tonumber(string.sub(flat[i], 1, colon - 1)), cap_class(cap)
      n = tonumber(flat[i + 1])
      c = n * cap
    end
    if n and n > 0 then
      k = k + 1
      starts[k], classes[k], ns[k], caps[k] = start, class, n, c
    end
  end
  return starts, classes, ns, caps, prompt
end

-- E[L | L > p] and Var[L | L > p] at every bucket start (the classes of one start share
-- them), keyed by start. The starts are sorted once and taken latest first, so their
-- progress p ascends and one walk along the model's thresholds serves them all, not a
-- search each. Between two thresholds E[L | L > t] is interpolated (it grows with t); past
-- the last, p + the mean excess there.
local function at_starts(model, starts, now, rate)
  local final, spread, order, n = {}, {}, {}, 0
  for i = 1, #starts do
    local s = starts[i]
    if not final[s] then
      final[s] = true
      n = n + 1
      order[n] = s
    end
  end
  table.sort(order)
  local t, m, v, tail = model['t'], model['m'], model['v'], model['tail']
  local last, lo = #t, 1
  for i = n, 1, -1 do
    local s = order[i]
    local p = max(0, now - s) * rate
    if p < t[1] then
      final[s], spread[s] = max(m[1], p), v[1]
    elseif p >= t[last] then
      final[s], spread[s] = p + tail, v[last]
    else
      while t[lo + 1] <= p do lo = lo + 1 end  -- the last threshold at or below p
      local hi = lo + 1
      local w = (p - t[lo]) / max(1, t[hi] - t[lo])
      final[s], spread[s] = max(m[lo] + w * (m[hi] - m[lo]), p), v[lo]
    end
  end
  return final, spread
end

-- Admission's view of a dataset's requests in flight: E[what they will count] and its
-- variance, from the (start, cap class) buckets and the length model (t/m/v table, see
-- admission.py). Until the model exists each request counts at its cap.
--   est = {expected, var, count, mean, rate, model, worst}; var includes the next request's
--   own; worst is what they count at the most (every one at its cap).
local function in_flight_estimate(buckets, model_key, now, prior_rate, prior_mean, total,
                                  precise)
  local model = read_model(model_key)
  local rate, mean = prior_rate, prior_mean
  if model then rate, mean = model['rate'], model['mean'] end
  local starts, classes, ns, caps, prompt = read_buckets(buckets)
  local expected, var, count, worst = 0, 0, 0, 0
  for i = 1, #ns do
    count = count + ns[i]
    worst = worst + caps[i]
  end
  if precise and not model then
    expected = worst
  elseif precise then
    local final, spread = at_starts(model, starts, now, rate)
    for i = 1, #ns do
      -- The bucket's start is its earliest: the most progress, the largest E[L | L > p].
      -- Each request counts min(E[L | L > p], its cap) (E[L | L > p] >= p: one past its
      -- cap counts its cap), so n of them count at most min(n * E[L | L > p], their caps).
      local s, n = starts[i], ns[i]
      expected = expected + min(n * final[s], caps[i])
      -- Past every cap of its class a request counts its cap: no spread.
      if max(0, now - s) * rate < 4 ^ (classes[i] + 1) then var = var + n * spread[s] end
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
