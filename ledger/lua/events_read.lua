-- Read the change feed after a position (RedisStore.read_events; ledger/events.py). Positions
-- are the stream's entry ids. This script only supplies the numbers; whether the position is
-- gone (410) is events.gone's rule, decided by the caller from the two ids answered first:
-- the stream's last-generated-id (the newest id ever issued: trims keep it; a failover that
-- lost writes or an older copy restored takes it back) and its max-deleted-entry-id (kept by
-- events_trim.lua). A stream that does not exist answers 0-0 for both.
-- KEYS[1] event stream
-- ARGV[1] test clock (unused; every script run through RedisStore._script receives it),
-- ARGV[2] the position to read after ('' for none: only the two ids), ARGV[3] most events
-- Returns {last generated id, max deleted id, id, body, id, body, ...}
local key, after, limit = KEYS[1], ARGV[2], tonumber(ARGV[3])

if redis.call('EXISTS', key) == 0 then return {'0-0', '0-0'} end
local flat = redis.call('XINFO', 'STREAM', key)
local info = {}
for i = 1, #flat, 2 do info[flat[i]] = flat[i + 1] end
local out = {info['last-generated-id'], info['max-deleted-entry-id']}
if after == '' then return out end
for _, entry in ipairs(redis.call('XRANGE', key, '(' .. after, '+', 'COUNT', limit)) do
  out[#out + 1] = entry[1]
  out[#out + 1] = entry[2][2]
end
return out
