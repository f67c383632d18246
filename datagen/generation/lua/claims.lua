-- Publish one worker's claims (its heartbeat): the samples its tasks run now, from their
-- start (right after the early ack) to their end, stamped with Redis's time, so a sweep can
-- tell a publication made after it looked (it then knows every task taken before).
-- KEYS[1] the owner's claims hash  ARGV[1] TTL ms  ARGV[2..] JSON [dataset, sample] members
-- Returns the stamp.
local now = redis_now()
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], '@at', string.format('%.6f', now))
for i = 2, #ARGV do
  redis.call('HSET', KEYS[1], ARGV[i], '1')
end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[1]))
return tostring(now)
