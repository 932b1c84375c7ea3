-- Cancel until the next revision (mirror of ledger.tasks.cancel), then the open dependents,
-- transitively (ledger.tasks.cancel_dependent, as ledger.sql_steps.cancel: `cascade` in
-- task_lib.lua), up to ARGV[3] of them in this step; the rest is recorded for cascade.lua.
-- KEYS[1] task hash, KEYS[2] leases index, KEYS[3] scheduler hash (the freeze only)
-- ARGV[1] test clock (see now_ms), ARGV[2] key prefix (see task_lib.lua),
-- ARGV[3] most dependents cancelled in this step (max_cascade)
-- Returns {'OK', fields...} (`discarded`: the attempts of the whole cascade) or
-- {'ERR', code, detail} (FROZEN: common.lua, check_not_frozen)
local frozen = check_not_frozen(KEYS[3])
if frozen then return frozen end
local now = now_ms(ARGV[1])
local t = load_hash(KEYS[1])
if not t then return err('NO_SUCH_TASK') end
if t.state == 'COMMITTED' then
  return err('ALREADY_COMMITTED', 'a committed task cannot be cancelled; revise it instead')
end
if t.state == 'CANCELLED' then return answer('OK', t) end
local before = before_of(t)
cancel_open(t, now)
save_hash(KEYS[1], t)
task_changed(KEYS[2], before, t)

cascade(KEYS[2], {t.task_id}, tonumber(ARGV[3]), now)
return task_answer('OK', t)
