-- Record the samples the consumer acknowledged: each frees its reserved bytes once.
-- An id never reserved in this epoch is ignored (another epoch's, or a stray).
-- KEYS[1] reserved  KEYS[2] acked  KEYS[3] totals
-- ARGV[1] the time  ARGV[2..] sample ids
-- Returns how many were new.
local fresh = 0
for i = 2, #ARGV do
  local bytes = redis.call('HGET', KEYS[1], ARGV[i])
  if bytes and redis.call('HSETNX', KEYS[2], ARGV[i], ARGV[1]) == 1 then
    redis.call('HINCRBY', KEYS[3], 'acked_bytes', tonumber(bytes))
    fresh = fresh + 1
  end
end
return fresh
