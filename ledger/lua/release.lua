-- Give a claim back (mirror of ledger.tasks.release); no epoch check, see tasks.py.
-- KEYS[1] task hash, KEYS[2] leases index
-- ARGV[1] test clock (see now_ms), ARGV[2] attemptId, ARGV[3] claimGeneration, ARGV[4] owner,
-- ARGV[5] cancelGeneration, ARGV[6] the caller's principal ('' for none)
-- Returns {'OK', fields...} or {'ERR', code, detail}
local now = now_ms(ARGV[1])
local t = load_hash(KEYS[1])
local bad = check_holder(t, ARGV[2], tonumber(ARGV[3]), ARGV[4], tonumber(ARGV[5]), false, 0, 0,
  ARGV[6])
if bad then return bad end
if t.state == 'COMMITTED' then return err('ALREADY_COMMITTED') end
t.state = 'READY'
t.attempt_id = nil
t.owner = nil
t.principal = nil
t.lease_expires_at = nil
t.attempt_started_at = nil
t.claim_epoch = nil
t.claim_revision = nil
t.updated_at = s(now)
save_hash(KEYS[1], t)
index_lease(KEYS[2], t)
return answer('OK', t)
