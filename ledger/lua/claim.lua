-- Claim a task (mirror of ledger.tasks.claim), once its bucket admits claims
-- (claim_admission, task_lib.lua: the operator's pause, a freeze, a bump's barrier).
-- KEYS[1] task hash, KEYS[2] scheduler hash, KEYS[3] leases index
-- ARGV[1] test clock (see now_ms), ARGV[2] key prefix (see task_lib.lua), ARGV[3] owner,
-- ARGV[4] ttlMs, ARGV[5] schedulerEpoch, ARGV[6] expectedRevision or '', ARGV[7] new attemptId,
-- ARGV[8] max ttl ms, ARGV[9] default max runtime ms, ARGV[10] the claiming principal ('' for
-- none)
-- Returns {'OK', fields...} (with `discarded` when it took over a claim) or {'ERR', code, detail}
-- (BARRIER and FROZEN among them: see claim_admission)
local now = now_ms(ARGV[1])
local epoch, barred = claim_admission(KEYS[2], now)
if not epoch then return barred end
local t = load_hash(KEYS[1])
if not t then return err('NO_SUCH_TASK') end
local req_epoch = tonumber(ARGV[5])
if req_epoch ~= epoch then
  return err('STALE_EPOCH', 'schedulerEpoch ' .. ARGV[5] .. ' is not the current ' .. s(epoch))
end
if ARGV[6] ~= '' and tonumber(ARGV[6]) ~= tonumber(t.revision) then
  return err('STALE_INPUT', 'expectedRevision ' .. ARGV[6] .. ' is not the current ' .. t.revision)
end
local before = before_of(t)
local refused = claim_task(t, now, epoch, ARGV[3], tonumber(ARGV[4]), ARGV[7], tonumber(ARGV[8]),
  tonumber(ARGV[9]), ARGV[10])
if refused then return refused end
save_hash(KEYS[1], t)
task_changed(KEYS[3], before, t)
return task_answer('OK', t)
