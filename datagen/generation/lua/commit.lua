-- Commit one stored record: count its tokens once, however often it was delivered.
-- KEYS[1] done hash      KEYS[2] stats hash     KEYS[3] inflight hash
-- KEYS[4] pending hash   KEYS[5] lengths list   KEYS[6] closed flag
-- KEYS[7] budgets hash     KEYS[8] recent speeds list   KEYS[9] progress zset
-- ARGV[1] dataset  ARGV[2] sample id  ARGV[3] rid  ARGV[4] counted tokens
-- ARGV[5] prompt tokens  ARGV[6] completion tokens  ARGV[7] truncated (0/1)
-- ARGV[8] default budget  ARGV[9] max samples (0 = none)  ARGV[10] lengths kept
-- ARGV[11] e2e latency in seconds (for the decode-rate estimate)  ARGV[12] now (s)
-- Returns {committed 0/1, committed tokens after, closed now 0/1}
local sample, rid = ARGV[2], ARGV[3]
local counted = tonumber(ARGV[4])

local function release()
  local held = redis.call('HGET', KEYS[3], sample)
  if held and cjson.decode(held)['rid'] == rid then
    redis.call('HDEL', KEYS[3], sample)
  end
end

release()
if redis.call('HEXISTS', KEYS[1], sample) == 1 then
  redis.call('HINCRBY', KEYS[2], 'duplicates', 1)
  return {0, tonumber(redis.call('HGET', KEYS[2], 'tokens') or '0'), 0}
end

redis.call('HSET', KEYS[1], sample, rid .. ' ' .. counted)
redis.call('HDEL', KEYS[4], sample)
local tokens = redis.call('HINCRBY', KEYS[2], 'tokens', counted)
redis.call('HINCRBY', KEYS[2], 'prompt_tokens', tonumber(ARGV[5]))
redis.call('HINCRBY', KEYS[2], 'completion_tokens', tonumber(ARGV[6]))
local samples = redis.call('HINCRBY', KEYS[2], 'samples', 1)
if ARGV[7] == '1' then redis.call('HINCRBY', KEYS[2], 'truncated', 1) end
local latency = tonumber(ARGV[11])
if latency and latency > 0 then
  redis.call('HINCRBYFLOAT', KEYS[2], 'decode_s', latency)
  redis.call('HINCRBY', KEYS[2], 'decoded', tonumber(ARGV[6]))
  -- Recent speeds: a server decodes faster as its batch drains.
  redis.call('LPUSH', KEYS[8], ARGV[6] .. ' ' .. latency)
  redis.call('LTRIM', KEYS[8], 0, 63)
end
redis.call('LPUSH', KEYS[5], ARGV[6])
redis.call('LTRIM', KEYS[5], 0, tonumber(ARGV[10]) - 1)
-- (time, tokens) points of the last two minutes: status's tokens/s over the last minute.
local now = tonumber(ARGV[12])
redis.call('ZADD', KEYS[9], now, tokens .. '@' .. ARGV[12])
redis.call('ZREMRANGEBYSCORE', KEYS[9], '-inf', now - 120)

local budget = tonumber(redis.call('HGET', KEYS[7], ARGV[1]) or ARGV[8])
local max_samples = tonumber(ARGV[9])
local closed_now = 0
if redis.call('EXISTS', KEYS[6]) == 0 then
  if tokens >= budget then
    redis.call('SET', KEYS[6], 'budget')
    closed_now = 1
  elseif max_samples > 0 and samples >= max_samples then
    redis.call('SET', KEYS[6], 'max_samples')
    closed_now = 1
  end
end
return {1, tokens, closed_now}
