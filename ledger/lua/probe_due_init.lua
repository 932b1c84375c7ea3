-- Fill the probe-due index from the UNKNOWN set once, for a ledger written before the index
-- existed (every UNKNOWN effect becomes due now). A no-op once the index exists.
-- KEYS[1] unknown index (set), KEYS[2] probe-due index (zset)
-- ARGV[1] clock offset ms (unused; every script receives it)
-- Returns the number of effects added.
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
local added = 0
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  added = added + redis.call('ZADD', KEYS[2], 'NX', 0, id)
end
return added
