-- Commit one stored record: count its tokens once, however often it was delivered.
-- Also: release the request's in-flight entry, clear a dead letter the sample left on an
-- earlier try, count the request against its server, and wake parked samples into the
-- slot it frees. One round trip per generated sample.
-- KEYS[1] run marker  KEYS[2] done hash  KEYS[3] stats hash  KEYS[4] flight hash
-- KEYS[5] pending hash  KEYS[6] lengths list  KEYS[7] closed flag  KEYS[8] budgets hash
-- KEYS[9] recent speeds list  KEYS[10] progress zset  KEYS[11] buckets hash
-- KEYS[12] leases zset  KEYS[13] parked zset  KEYS[14] dead hash  KEYS[15] model lock
-- KEYS[16] server requests hash  KEYS[17] server latency hash  KEYS[18] server tokens hash
-- ARGV[1] dataset  ARGV[2] sample id  ARGV[3] rid  ARGV[4] counted tokens
-- ARGV[5] prompt tokens  ARGV[6] completion tokens  ARGV[7] truncated (0/1)
-- ARGV[8] default budget  ARGV[9] max samples (0 = none)  ARGV[10] lengths kept
-- ARGV[11] e2e latency in seconds  ARGV[12] server label  ARGV[13] most parked samples to wake
-- ARGV[14] model refresh interval (ms)  ARGV[15] prior tokens per second of a request
-- ARGV[16] prior mean response length  ARGV[17] measure  ARGV[18] margin in sd
-- ARGV[19] precise admission (1) or naive (0)
-- ARGV[20] 1: count the record only while this rid holds the sample's in-flight entry (its
--          states were captured: prepare's prune deletes the files of attempts neither in
--          flight nor counted, so a lapsed or reaped attempt's file may be gone already)
-- KEYS[19] model string
-- Returns {status, committed tokens after, closed now 0/1, refresh the model 0/1,
--          payload to enqueue, ...}; status "ok" | "duplicate" | "lost" (no run marker:
--          hold the commit, the record is safe on disk, until the ledger is rebuilt) |
--          "lapsed" (ARGV[20] and the entry is not this rid's: not counted, nothing changed)
local sample, rid = ARGV[2], ARGV[3]
local counted = tonumber(ARGV[4])
if redis.call('EXISTS', KEYS[1]) == 0 then return {'lost', 0, 0, 0} end

if not release_own(KEYS[4], KEYS[11], KEYS[12], sample, rid) and ARGV[20] == '1' then
  return {'lapsed', tonumber(redis.call('HGET', KEYS[3], 'tokens') or '0'), 0, 0}
end
local function woken(head)
  return wake_into_room(
    {closed = KEYS[7], parked = KEYS[13], pending = KEYS[5], buckets = KEYS[11],
     model = KEYS[19], stats = KEYS[3], budgets = KEYS[8]},
    {dataset = ARGV[1], budget = ARGV[8], rate = tonumber(ARGV[15]), mean = tonumber(ARGV[16]),
     total = ARGV[17] == 'total', margin = tonumber(ARGV[18]), precise = ARGV[19] == '1',
     most = tonumber(ARGV[13])}, head)
end

if redis.call('HEXISTS', KEYS[2], sample) == 1 then
  -- Counted already (an earlier delivery, or a rebuild that found this record on disk).
  redis.call('HINCRBY', KEYS[3], 'duplicates', 1)
  redis.call('HDEL', KEYS[5], sample)
  redis.call('ZREM', KEYS[13], sample)
  return woken({'duplicate', tonumber(redis.call('HGET', KEYS[3], 'tokens') or '0'), 0, 0})
end

redis.call('HSET', KEYS[2], sample, rid .. ' ' .. counted)
redis.call('HDEL', KEYS[5], sample)
redis.call('HDEL', KEYS[14], sample)
redis.call('ZREM', KEYS[13], sample)
local tokens = redis.call('HINCRBY', KEYS[3], 'tokens', counted)
redis.call('HINCRBY', KEYS[3], 'prompt_tokens', tonumber(ARGV[5]))
redis.call('HINCRBY', KEYS[3], 'completion_tokens', tonumber(ARGV[6]))
local samples = redis.call('HINCRBY', KEYS[3], 'samples', 1)
if ARGV[7] == '1' then redis.call('HINCRBY', KEYS[3], 'truncated', 1) end
local latency = tonumber(ARGV[11])
if latency and latency > 0 then
  redis.call('HINCRBYFLOAT', KEYS[3], 'decode_s', latency)
  redis.call('HINCRBY', KEYS[3], 'decoded', tonumber(ARGV[6]))
  -- Recent speeds: a server decodes faster as its batch drains.
  redis.call('LPUSH', KEYS[9], ARGV[6] .. ' ' .. latency)
  redis.call('LTRIM', KEYS[9], 0, 63)
  redis.call('HINCRBY', KEYS[16], ARGV[12], 1)
  redis.call('HINCRBYFLOAT', KEYS[17], ARGV[12], latency)
  redis.call('HINCRBY', KEYS[18], ARGV[12], tonumber(ARGV[6]))
end
redis.call('LPUSH', KEYS[6], ARGV[6])
redis.call('LTRIM', KEYS[6], 0, tonumber(ARGV[10]) - 1)
-- (time, tokens) points of the last two minutes: status's tokens/s over the last minute.
local now = redis_now()
redis.call('ZADD', KEYS[10], now, tokens .. '@' .. now)
redis.call('ZREMRANGEBYSCORE', KEYS[10], '-inf', now - 120)

local budget = tonumber(redis.call('HGET', KEYS[8], ARGV[1]) or ARGV[8])
local max_samples = tonumber(ARGV[9])
local closed_now = 0
if redis.call('EXISTS', KEYS[7]) == 0 then
  if tokens >= budget then
    redis.call('SET', KEYS[7], 'budget')
    closed_now = 1
  elseif max_samples > 0 and samples >= max_samples then
    redis.call('SET', KEYS[7], 'max_samples')
    closed_now = 1
  end
  if closed_now == 1 then redis.call('DEL', KEYS[13]) end
end
-- At most one model refresh per interval per dataset, across all workers.
local refresh = 0
if redis.call('SET', KEYS[15], '1', 'NX', 'PX', tonumber(ARGV[14])) then refresh = 1 end
return woken({'ok', tokens, closed_now, refresh})
