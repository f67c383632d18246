-- Renew the leases of one owner's requests of one dataset (its heartbeat).
-- Only entries still held by the given rid are renewed: a reclaimed or re-admitted
-- sample is not the owner's any more.
-- KEYS[1] flight  KEYS[2] leases
-- ARGV[1] lease seconds  ARGV[2..] sample, rid, sample, rid, ...
-- Returns how many leases were renewed.
local deadline = redis_now() + tonumber(ARGV[1])
local renewed = 0
for i = 2, #ARGV, 2 do
  local raw = redis.call('HGET', KEYS[1], ARGV[i])
  if raw and cjson.decode(raw)['rid'] == ARGV[i + 1] then
    redis.call('ZADD', KEYS[2], deadline, ARGV[i])
    renewed = renewed + 1
  end
end
return renewed
