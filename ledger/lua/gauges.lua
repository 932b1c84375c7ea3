-- What is in flight right now, from the indexes the other scripts keep (one round trip).
-- Mirror of ledger.queries.gauges: a lease is active while its expiry (the leases index's
-- score) is above now (is_lease_active); a PREPARED is overdue once now reaches its deadline
-- (the prepared index's score; ledger.effects.is_overdue) and then counts as UNKNOWN; the
-- awaiting set holds exactly the effects ledger.effects.is_awaiting_approval accepts. The
-- keyed UNKNOWN ones (Gauges.unknown_keyed_effects) are counted by the same rule from the
-- keyed companions of the prepared and unknown indexes (effect_lib.lua's index_effect).
-- KEYS[1] leases index, KEYS[2] prepared index, KEYS[3] unknown index, KEYS[4] awaiting index,
-- KEYS[5] keyed-prepared index, KEYS[6] keyed-unknown index
-- ARGV[1] test clock (see now_ms)
-- Returns {active leases, PREPARED still running, UNKNOWN (incl. overdue PREPARED), awaiting,
--          keyed UNKNOWN (incl. overdue keyed PREPARED)}
local leases, prepared, unknown, awaiting = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local keyed_prepared, keyed_unknown = KEYS[5], KEYS[6]
local now = now_ms(ARGV[1])

local active = redis.call('ZCOUNT', leases, '(' .. s(now), '+inf')
local running = redis.call('ZCOUNT', prepared, '(' .. s(now), '+inf')
local overdue = redis.call('ZCOUNT', prepared, '-inf', s(now))
local keyed_overdue = redis.call('ZCOUNT', keyed_prepared, '-inf', s(now))
return {active, running, redis.call('SCARD', unknown) + overdue, redis.call('SCARD', awaiting),
        redis.call('SCARD', keyed_unknown) + keyed_overdue}
