-- Claim a task (mirror of ledger.tasks.claim).
-- KEYS[1] task hash, KEYS[2] scheduler hash, KEYS[3] leases index
-- ARGV[1] test clock (see now_ms), ARGV[2] owner, ARGV[3] ttlMs, ARGV[4] schedulerEpoch,
-- ARGV[5] expectedRevision or '', ARGV[6] new attemptId, ARGV[7] max ttl ms,
-- ARGV[8] default max runtime ms, ARGV[9] the claiming principal ('' for none)
-- Returns {'OK', fields...} or {'ERR', code, detail}
local now = now_ms(ARGV[1])
local epoch, paused = scheduler(KEYS[2])
if paused then return err('CLAIMS_PAUSED', 'claims are paused by an operator; retry later') end
local t = load_hash(KEYS[1])
if not t then return err('NO_SUCH_TASK') end
local req_epoch = tonumber(ARGV[4])
if req_epoch ~= epoch then
  return err('STALE_EPOCH', 'schedulerEpoch ' .. ARGV[4] .. ' is not the current ' .. s(epoch))
end
if ARGV[5] ~= '' and tonumber(ARGV[5]) ~= tonumber(t.revision) then
  return err('STALE_INPUT', 'expectedRevision ' .. ARGV[5] .. ' is not the current ' .. t.revision)
end
if t.state == 'COMMITTED' then return err('ALREADY_COMMITTED') end
if t.state == 'CANCELLED' then return err('CANCELLED') end
if t.state == 'CLAIMED' and num(t.claim_epoch) == epoch and t.lease_expires_at
    and now < tonumber(t.lease_expires_at) then
  return err('CLAIMED', 'held until leaseExpiresAt ' .. t.lease_expires_at,
    'leaseExpiresAt', t.lease_expires_at, 'retryAfterMs', s(tonumber(t.lease_expires_at) - now))
end
local runtime = num(t.max_runtime_ms) or tonumber(ARGV[8])
local ttl = math.min(tonumber(ARGV[3]), tonumber(ARGV[7]), runtime)
if t.state == 'CLAIMED' then
  t.previous_lease_expires_at = t.lease_expires_at
else
  t.previous_lease_expires_at = nil
end
t.state = 'CLAIMED'
t.claim_generation = s(tonumber(t.claim_generation) + 1)
t.attempt_id = ARGV[6]
t.owner = ARGV[2]
if ARGV[9] ~= '' then t.principal = ARGV[9] else t.principal = nil end
t.lease_expires_at = s(now + ttl)
t.attempt_started_at = s(now)
t.claim_epoch = s(epoch)
t.claim_revision = t.revision
t.updated_at = s(now)
save_hash(KEYS[1], t)
index_lease(KEYS[3], t)
return answer('OK', t)
