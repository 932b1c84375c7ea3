-- Cancel until the next revision (mirror of ledger.tasks.cancel), then every open dependent,
-- transitively (ledger.tasks.cancel_dependent, in the order of ledger.sql_steps.cancel):
-- breadth first, each task once; a dependent that changed passes the cancel on to its own
-- dependents, a committed or already cancelled one stops it there.
-- KEYS[1] task hash, KEYS[2] leases index
-- ARGV[1] test clock (see now_ms), ARGV[2] key prefix (see task_lib.lua)
-- Returns {'OK', fields...} (`discarded`: the attempts of the whole cascade) or
-- {'ERR', code, detail}
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

local seen = {[t.task_id] = true}
local frontier, head = sorted_members(dependents_key(t.task_id)), 1
while head <= #frontier do
  local id = frontier[head]
  head = head + 1
  if not seen[id] then
    seen[id] = true
    local key = task_key(id)
    local d = load_hash(key)
    if d and OPEN[d.state] then
      local d_before = before_of(d)
      cancel_open(d, now)
      save_task(KEYS[2], d_before, d)
      for _, next_id in ipairs(sorted_members(dependents_key(id))) do
        frontier[#frontier + 1] = next_id
      end
    else
      loaded[key] = nil
    end
  end
end
return task_answer('OK', t)
