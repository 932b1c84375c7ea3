-- Drop the oldest events beyond the newest `keep` (RedisStore.trim_events), at most `most` per
-- run (the caller runs it again while it drops that many), and record the newest dropped id
-- as the stream's max-deleted-entry-id (XSETID ... MAXDELETEDID): XTRIM does not, and
-- events_read.lua answers GONE for a position below it.
-- KEYS[1] event stream
-- ARGV[1] test clock (unused; every script run through RedisStore._script receives it),
-- ARGV[2] keep, ARGV[3] most
-- Returns the number of events dropped.
local key, keep, most = KEYS[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local length = redis.call('XLEN', key)
local n = math.min(length - keep, most)
if n <= 0 then return 0 end
local dropped = redis.call('XRANGE', key, '-', '+', 'COUNT', n)
local newest = dropped[#dropped][1]
local flat = redis.call('XINFO', 'STREAM', key)
local info = {}
for i = 1, #flat, 2 do info[flat[i]] = flat[i + 1] end
redis.call('XTRIM', key, 'MAXLEN', length - n)
redis.call('XSETID', key, info['last-generated-id'], 'MAXDELETEDID', newest)
return n
