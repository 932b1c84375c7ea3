-- Extend a lease (mirror of ledger.tasks.renew).
-- KEYS[1] task hash, KEYS[2] scheduler hash, KEYS[3] leases index
-- ARGV[1] test clock (see now_ms), ARGV[2] attemptId, ARGV[3] claimGeneration, ARGV[4] owner,
-- ARGV[5] schedulerEpoch, ARGV[6] cancelGeneration, ARGV[7] ttlMs, ARGV[8] max ttl ms,
-- ARGV[9] default max runtime ms, ARGV[10] the caller's principal ('' for none)
-- Returns {'OK', fields...} or {'ERR', code, detail}
local now = now_ms(ARGV[1])
local epoch = scheduler(KEYS[2])
local t = load_hash(KEYS[1])
local bad = check_holder(t, ARGV[2], tonumber(ARGV[3]), ARGV[4], tonumber(ARGV[6]), true, epoch,
  tonumber(ARGV[5]), ARGV[10])
if bad then return bad end
if t.state == 'COMMITTED' then return err('ALREADY_COMMITTED') end
local expires = tonumber(t.lease_expires_at)
if now >= expires then
  return err('LEASE_EXPIRED', 'lease expired at leaseExpiresAt ' .. t.lease_expires_at,
    'leaseExpiresAt', t.lease_expires_at)
end
local deadline = tonumber(t.attempt_started_at) + (num(t.max_runtime_ms) or tonumber(ARGV[9]))
if expires >= deadline then
  return err('RUNTIME_EXCEEDED', 'the attempt may not run past runtimeEndsAt ' .. s(deadline),
    'runtimeEndsAt', s(deadline))
end
t.lease_expires_at = s(math.min(now + math.min(tonumber(ARGV[7]), tonumber(ARGV[8])), deadline))
t.updated_at = s(now)
save_hash(KEYS[1], t)
index_lease(KEYS[3], t)
return answer('OK', t)
