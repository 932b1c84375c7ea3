-- The ids of a stream's newest events, newest first, before a position (ids only: the
-- cluster store's trim looks for one cut-off over every bucket's newest ids, and moves ids,
-- not event bodies). Read-only.
-- KEYS[1] event stream
-- ARGV[1] test clock (unused; every script run through RedisStore._script receives it),
-- ARGV[2] the id to read before ('' for the newest), ARGV[3] most ids
-- Returns the ids, newest first.
local key, before, most = KEYS[1], ARGV[2], tonumber(ARGV[3])
local from = '+'
if before ~= '' then from = '(' .. before end
local out = {}
for i, entry in ipairs(redis.call('XREVRANGE', key, from, '-', 'COUNT', most)) do
  out[i] = entry[1]
end
return out
