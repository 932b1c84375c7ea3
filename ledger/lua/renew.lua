-- Extend a lease (mirror of ledger.tasks.renew).
-- KEYS[1] task hash, KEYS[2] scheduler hash, KEYS[3] leases index
-- ARGV[1] test clock (see now_ms), ARGV[2] key prefix (see task_lib.lua), ARGV[3] attemptId,
-- ARGV[4] claimGeneration, ARGV[5] owner, ARGV[6] schedulerEpoch, ARGV[7] cancelGeneration,
-- ARGV[8] ttlMs, ARGV[9] max ttl ms, ARGV[10] default max runtime ms, ARGV[11] the caller's
-- principal ('' for none), ARGV[12] the attempt's cost since its last report (JSON object) or ''
-- Returns {'OK', fields...} or {'ERR', code, detail} (FROZEN: task_lib.lua, step_epoch)
local now = now_ms(ARGV[1])
local epoch, frozen = step_epoch(KEYS[2])
if not epoch then return frozen end
local t = load_hash(KEYS[1])
local bad = check_holder(t, ARGV[3], tonumber(ARGV[4]), ARGV[5], tonumber(ARGV[7]), true, epoch,
  tonumber(ARGV[6]), ARGV[11])
if bad then return bad end
if t.state == 'COMMITTED' then return err('ALREADY_COMMITTED') end
local expires = tonumber(t.lease_expires_at)
if now >= expires then
  return err('LEASE_EXPIRED', 'lease expired at leaseExpiresAt ' .. t.lease_expires_at,
    'leaseExpiresAt', t.lease_expires_at)
end
local deadline = tonumber(t.attempt_started_at) + (num(t.max_runtime_ms) or tonumber(ARGV[10]))
if expires >= deadline then
  return err('RUNTIME_EXCEEDED', 'the attempt may not run past runtimeEndsAt ' .. s(deadline),
    'runtimeEndsAt', s(deadline))
end
local before = before_of(t)
t.lease_expires_at = s(math.min(now + math.min(tonumber(ARGV[8]), tonumber(ARGV[9])), deadline))
t.updated_at = s(now)
t.attempt_cost = add_cost(t.attempt_cost, ARGV[12])
save_hash(KEYS[1], t)
index_lease(KEYS[3], t)
if t.queue then
  -- Still CLAIMED in the same queue under the same epoch: only the held index's score moves.
  -- (The other two calls matter only when claim_next moved the task into `ready` under a
  -- clock that said the lease had run out, and a test clock then went back.)
  redis.call('ZADD', queue_key(t.queue, 'held'), tonumber(t.lease_expires_at), t.task_id)
  redis.call('ZADD', queue_key(t.queue, 'epochs'), tonumber(t.claim_epoch), t.task_id)
  redis.call('ZREM', queue_key(t.queue, 'ready'), queue_member(before))
end
return answer('OK', t)
