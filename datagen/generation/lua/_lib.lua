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
