-- Wake parked samples of a dataset (a budget raise, or a stalled dataset): they leave
-- the parked set and their payloads go back to the caller to enqueue.
-- KEYS[1] parked  KEYS[2] pending  KEYS[3] closed flag
-- ARGV[1] how many (0: all)
-- Returns the payloads.
if redis.call('EXISTS', KEYS[3]) == 1 then return {} end
local n = tonumber(ARGV[1])
if n <= 0 then n = redis.call('ZCARD', KEYS[1]) end
return wake(KEYS[1], KEYS[2], n)
