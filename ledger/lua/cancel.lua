-- Cancel until the next revision (mirror of ledger.tasks.cancel).
-- KEYS[1] task hash, KEYS[2] leases index
-- ARGV[1] test clock (see now_ms)
-- Returns {'OK', fields...} or {'ERR', code, detail}
local now = now_ms(ARGV[1])
local t = load_hash(KEYS[1])
if not t then return err('NO_SUCH_TASK') end
if t.state == 'COMMITTED' then
  return err('ALREADY_COMMITTED', 'a committed task cannot be cancelled; revise it instead')
end
if t.state == 'CANCELLED' then return answer('OK', t) end
t.state = 'CANCELLED'
t.cancel_generation = s(tonumber(t.cancel_generation) + 1)
t.updated_at = s(now)
save_hash(KEYS[1], t)
index_lease(KEYS[2], t)
return answer('OK', t)
