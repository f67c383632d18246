-- Reclaim in-flight entries whose lease is stale, whoever owns them: the owner died,
-- was restarted (a new owner id), or lost a release in a Redis blip. Atomic, so exactly
-- one reaper re-enqueues each sample.
-- KEYS[1] flight  KEYS[2] buckets  KEYS[3] leases  KEYS[4] pending  KEYS[5] stats
-- KEYS[6] closed flag  KEYS[7] the fleet's contact-since key (contact.lua)
-- ARGV[1] most entries to reclaim in this call
-- ARGV[2] seconds of unbroken fleet contact required first (0: none). Checked here, at the
-- moment the script runs: a reaper's call sent before a partition and delivered after it
-- must not act on what it saw before (live workers have not renewed yet).
-- Returns {sample, payload or "", worker, rid, server, ...} for every entry reclaimed
-- (rid and server: the reaper aborts the dead owner's request, which runs on otherwise).
local now = redis_now()
local need = tonumber(ARGV[2] or '0')
if need > 0 then
  local since = tonumber(redis.call('GET', KEYS[7]) or '')
  if not since or now - since < need then return {} end
end
local stale = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))
local closed = redis.call('EXISTS', KEYS[6]) == 1
local out = {}
for _, sample in ipairs(stale) do
  local raw = redis.call('HGET', KEYS[1], sample)
  if raw then
    local entry = cjson.decode(raw)
    local worker = entry['worker'] or ''
    drop_entry(KEYS[1], KEYS[2], KEYS[3], sample, raw)
    redis.call('HINCRBY', KEYS[5], 'reaped', 1)
    local payload = ''
    if not closed then payload = redis.call('HGET', KEYS[4], sample) or '' end
    out[#out + 1] = sample
    out[#out + 1] = payload
    out[#out + 1] = worker
    out[#out + 1] = entry['rid'] or ''
    out[#out + 1] = entry['server'] or ''
  else
    redis.call('ZREM', KEYS[3], sample)
  end
end
return out
