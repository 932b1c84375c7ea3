-- Put every UNKNOWN effect missing from the probe-due index into it (due now): for a ledger
-- written before the index existed, and while gateways of an older version, which do not
-- keep the index, share the store. Runs before each reconciler sweep; costs one ZCARD and one
-- SCARD while the index is complete.
-- KEYS[1] unknown index (set), KEYS[2] probe-due index (zset)
-- ARGV[1] test clock (unused; every script run through RedisStore._script receives it)
-- Returns the number of effects added.
if redis.call('ZCARD', KEYS[2]) >= redis.call('SCARD', KEYS[1]) then return 0 end
local added = 0
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  added = added + redis.call('ZADD', KEYS[2], 'NX', 0, id)
end
return added
