-- Record the canonical result (mirror of ledger.tasks.commit). Compares identities, not the clock.
-- KEYS[1] task hash, KEYS[2] scheduler hash, KEYS[3] leases index
-- ARGV[1] test clock (see now_ms), ARGV[2] attemptId, ARGV[3] claimGeneration,
-- ARGV[4] schedulerEpoch, ARGV[5] cancelGeneration, ARGV[6] inputDigest, ARGV[7] resultDigest,
-- ARGV[8] new commitId, ARGV[9] result JSON or '' for none,
-- ARGV[10] the caller's principal ('' for none)
-- Returns {'OK'|'REPLAY', fields...} or {'ERR', code, detail}
local now = now_ms(ARGV[1])
local epoch = scheduler(KEYS[2])
local t = load_hash(KEYS[1])
local generation = tonumber(ARGV[3])
if t and t.state == 'COMMITTED' and t.commit_id and t.commit_attempt_id == ARGV[2]
    and tonumber(t.commit_generation) == generation and t.commit_result_digest == ARGV[7] then
  local other = check_principal(t, ARGV[10])
  if other then return other end
  return answer('REPLAY', t)
end
local bad = check_holder(t, ARGV[2], generation, nil, tonumber(ARGV[5]), true, epoch,
  tonumber(ARGV[4]), ARGV[10])
if bad then return bad end
if ARGV[6] ~= t.input_digest then
  return err('STALE_INPUT', "inputDigest is not the task's current input")
end
if t.state == 'COMMITTED' then
  return err('ALREADY_COMMITTED', 'this attempt already committed a different resultDigest')
end
t.state = 'COMMITTED'
t.commit_id = ARGV[8]
t.commit_attempt_id = ARGV[2]
t.commit_generation = ARGV[3]
t.commit_result_digest = ARGV[7]
t.committed_at = s(now)
if ARGV[9] ~= '' then t.commit_result = ARGV[9] end
t.updated_at = s(now)
save_hash(KEYS[1], t)
index_lease(KEYS[3], t)
return answer('OK', t)
