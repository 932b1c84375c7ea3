-- Validate a proxied call's claim without recording anything (mirror of
-- ledger.effects.check_fence): safe methods (GET, HEAD, OPTIONS).
-- KEYS[1] task hash, KEYS[2] scheduler hash
-- ARGV[1] test clock (see now_ms), ARGV[2] attemptId, ARGV[3] claimGeneration,
-- ARGV[4] schedulerEpoch, ARGV[5] cancelGeneration, ARGV[6] the caller's principal ('' for none)
-- Returns {'OK', task fields...} or {'ERR', code, detail}
local now = now_ms(ARGV[1])
local epoch = scheduler(KEYS[2])
local t = load_hash(KEYS[1])
local bad = check_holder(t, ARGV[2], tonumber(ARGV[3]), nil, tonumber(ARGV[5]), true, epoch,
  tonumber(ARGV[4]), ARGV[6])
if bad then return bad end
if t.state == 'COMMITTED' then
  return err('ALREADY_COMMITTED', 'the task is committed; its attempt may produce no more effects')
end
if now >= tonumber(t.lease_expires_at) then
  return err('LEASE_EXPIRED', 'lease expired at leaseExpiresAt ' .. t.lease_expires_at,
    'leaseExpiresAt', t.lease_expires_at)
end
return answer('OK', t)
