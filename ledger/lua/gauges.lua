-- What is in flight right now, from the indexes the other scripts keep (one round trip).
-- KEYS[1] leases index, KEYS[2] prepared index, KEYS[3] unknown index, KEYS[4] awaiting index
-- ARGV[1] clock offset ms
-- Returns {active leases, PREPARED still running, UNKNOWN (incl. overdue PREPARED), awaiting}
local now = now_ms(ARGV[1])
local active = redis.call('ZCOUNT', KEYS[1], '(' .. s(now), '+inf')
local running = redis.call('ZCOUNT', KEYS[2], '(' .. s(now), '+inf')
local overdue = redis.call('ZCOUNT', KEYS[2], '-inf', s(now))
return {active, running, redis.call('SCARD', KEYS[3]) + overdue, redis.call('SCARD', KEYS[4])}
