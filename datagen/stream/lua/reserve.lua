-- Take room for one sample under the resident bound before its put, or say there is none.
-- A sample already reserved keeps its room (a re-run after a crash between reserve and put
-- puts it again); the first sample always fits (a sample above the bound alone must not wait
-- forever for acks that cannot come).
-- KEYS[1] reserved  KEYS[2] totals
-- ARGV[1] sample id  ARGV[2] its bytes  ARGV[3] bound in bytes
-- Returns 1 when the sample may be put, 0 when resident + its bytes would pass the bound.
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then
  return 1
end
local bytes = tonumber(ARGV[2])
local resident = tonumber(redis.call('HGET', KEYS[2], 'reserved_bytes') or '0')
  - tonumber(redis.call('HGET', KEYS[2], 'acked_bytes') or '0')
if resident > 0 and resident + bytes > tonumber(ARGV[3]) then
  return 0
end
redis.call('HSET', KEYS[1], ARGV[1], bytes)
redis.call('HINCRBY', KEYS[2], 'reserved_bytes', bytes)
return 1
