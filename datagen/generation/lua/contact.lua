-- The fleet's unbroken contact with Redis, marked by every successful heartbeat.
-- The key holds the Redis time at which the current stretch of contact began; each beat
-- keeps it alive for ARGV[1] ms (half a lease, three times the beat interval of a sixth).
-- When no worker reached Redis for that long (Redis unreachable, restarted or emptied), the
-- key is gone and the next beat starts a new stretch: reapers then wait a lease, so every
-- live worker renews first. A reaper that starts while the fleet is in touch reaps at once.
-- KEYS[1] contact-since key
-- ARGV[1] ttl in ms
-- Returns {since, now, began} (Redis time, seconds, as strings; began 1 when this beat
-- started a new stretch, else 0).
local now = redis_now()
local began = redis.call('SET', KEYS[1], string.format('%.6f', now), 'NX') and 1 or 0
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return {redis.call('GET', KEYS[1]), string.format('%.6f', now), began}
