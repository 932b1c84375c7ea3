-- Create a task or open a new revision (mirror of ledger.tasks.put).
-- KEYS[1] task hash, KEYS[2] leases index, KEYS[3] tasks index (every task id, score 0)
-- ARGV[1] test clock (see now_ms), ARGV[2] taskId, ARGV[3] inputDigest, ARGV[4] maxRuntimeMs or ''
-- Returns {'CREATED'|'REVISED'|'UNCHANGED', fields...}
local now = now_ms(ARGV[1])
local t = load_hash(KEYS[1])
if not t then
  t = {task_id = ARGV[2], state = 'READY', revision = '1', input_digest = ARGV[3],
       claim_generation = '0', cancel_generation = '0', created_at = s(now), updated_at = s(now),
       ready_at = s(now)}
  if ARGV[4] ~= '' then t.max_runtime_ms = ARGV[4] end
  save_hash(KEYS[1], t)
  redis.call('ZADD', KEYS[3], 0, ARGV[2])
  return answer('CREATED', t)
end
if t.input_digest == ARGV[3] then
  return answer('UNCHANGED', t)
end
t.state = 'READY'
t.revision = s(tonumber(t.revision) + 1)
t.input_digest = ARGV[3]
if ARGV[4] ~= '' then t.max_runtime_ms = ARGV[4] end
t.commit_id = nil
t.commit_attempt_id = nil
t.commit_generation = nil
t.commit_result_digest = nil
t.committed_at = nil
t.commit_result = nil
t.updated_at = s(now)
t.ready_at = s(now)
save_hash(KEYS[1], t)
index_lease(KEYS[2], t)
return answer('REVISED', t)
