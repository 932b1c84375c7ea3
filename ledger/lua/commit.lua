-- Record the canonical result (mirror of ledger.tasks.commit). Compares identities, not the clock.
-- A first commit also records itself in its open dependents (ledger.tasks.dependency_committed:
-- the last dependency to commit makes a WAITING dependent READY), in the same step.
-- KEYS[1] task hash, KEYS[2] scheduler hash, KEYS[3] leases index
-- ARGV[1] test clock (see now_ms), ARGV[2] key prefix (see task_lib.lua), ARGV[3] attemptId,
-- ARGV[4] claimGeneration, ARGV[5] schedulerEpoch, ARGV[6] cancelGeneration,
-- ARGV[7] inputDigest, ARGV[8] resultDigest, ARGV[9] new commitId, ARGV[10] result JSON or ''
-- for none, ARGV[11] the caller's principal ('' for none), ARGV[12] the attempt's cost since
-- its last report (JSON object) or ''
-- Returns {'OK'|'REPLAY', fields...} or {'ERR', code, detail} (FROZEN: task_lib.lua,
-- step_epoch)
local now = now_ms(ARGV[1])
local epoch, frozen = step_epoch(KEYS[2])
if not epoch then return frozen end
local t = load_hash(KEYS[1])
local generation = tonumber(ARGV[4])
if t and t.state == 'COMMITTED' and t.commit_id and t.commit_attempt_id == ARGV[3]
    and tonumber(t.commit_generation) == generation and t.commit_result_digest == ARGV[8] then
  local other = check_principal(t, ARGV[11])
  if other then return other end
  return answer('REPLAY', t)
end
local bad = check_holder(t, ARGV[3], generation, nil, tonumber(ARGV[6]), true, epoch,
  tonumber(ARGV[5]), ARGV[11])
if bad then return bad end
if ARGV[7] ~= t.input_digest then
  return err('STALE_INPUT', "inputDigest is not the task's current input")
end
if t.state == 'COMMITTED' then
  return err('ALREADY_COMMITTED', 'this attempt already committed a different resultDigest')
end
local before = before_of(t)
t.state = 'COMMITTED'
t.commit_id = ARGV[9]
t.commit_attempt_id = ARGV[3]
t.commit_generation = ARGV[4]
t.commit_result_digest = ARGV[8]
t.committed_at = s(now)
if ARGV[10] ~= '' then t.commit_result = ARGV[10] end
t.updated_at = s(now)
t.attempt_cost = add_cost(t.attempt_cost, ARGV[12])
save_hash(KEYS[1], t)
task_changed(KEYS[3], before, t)
update_dependents(KEYS[3], t.task_id, function(d) return dependency_committed(d, t, now) end)
return answer('OK', t)
