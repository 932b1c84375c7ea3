-- Drop the oldest events beyond the newest `keep` (RedisStore.trim_events), at most `most` per
-- run (the caller runs it again while it drops that many), and record the newest dropped id
-- as the stream's max-deleted-entry-id (XSETID ... MAXDELETEDID): XTRIM does not, and
-- events_read.lua answers GONE for a position below it. With `before`, only events whose id
-- is below it are dropped (the cluster store's one cut-off across buckets).
-- KEYS[1] event stream
-- ARGV[1] test clock (unused; every script run through RedisStore._script receives it),
-- ARGV[2] keep, ARGV[3] most, ARGV[4] before (optional: a stream id; '' or absent: any)
-- Returns the number of events dropped.
local key, keep, most = KEYS[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local before = ARGV[4] or ''
local length = redis.call('XLEN', key)
local n = math.min(length - keep, most)
if n <= 0 then return 0 end
local upto = '+'
if before ~= '' then upto = '(' .. before end
local dropped = redis.call('XRANGE', key, '-', upto, 'COUNT', n)
n = #dropped
if n == 0 then return 0 end
local newest = dropped[n][1]
local flat = redis.call('XINFO', 'STREAM', key)
local info = {}
for i = 1, #flat, 2 do info[flat[i]] = flat[i + 1] end
redis.call('XTRIM', key, 'MAXLEN', length - n)
redis.call('XSETID', key, info['last-generated-id'], 'MAXDELETEDID', newest)
return n
