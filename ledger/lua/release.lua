-- Give a claim back (mirror of ledger.tasks.release); no epoch check, see tasks.py.
-- KEYS[1] task hash, KEYS[2] leases index, KEYS[3] scheduler hash (the freeze only)
-- ARGV[1] test clock (see now_ms), ARGV[2] key prefix (see task_lib.lua), ARGV[3] attemptId,
-- ARGV[4] claimGeneration, ARGV[5] owner, ARGV[6] cancelGeneration, ARGV[7] the caller's
-- principal ('' for none)
-- Returns {'OK', fields...} or {'ERR', code, detail} (FROZEN: common.lua, check_not_frozen)
local frozen = check_not_frozen(KEYS[3])
if frozen then return frozen end
local now = now_ms(ARGV[1])
local t = load_hash(KEYS[1])
local bad = check_holder(t, ARGV[3], tonumber(ARGV[4]), ARGV[5], tonumber(ARGV[6]), false, 0, 0,
  ARGV[7])
if bad then return bad end
if t.state == 'COMMITTED' then return err('ALREADY_COMMITTED') end
local before = before_of(t)
t.state = 'READY'
t.attempt_id = nil
t.owner = nil
t.principal = nil
t.lease_expires_at = nil
t.attempt_started_at = nil
t.claim_epoch = nil
t.claim_revision = nil
t.attempt_cost = nil
t.updated_at = s(now)
save_hash(KEYS[1], t)
task_changed(KEYS[2], before, t)
return answer('OK', t)
