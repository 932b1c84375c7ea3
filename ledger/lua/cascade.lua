-- Carry recorded cascades on (mirror of ledger.sql_steps.continue_cascades): recorded tasks
-- taken one by one until ARGV[3] tasks were cancelled or ARGV[3] records were taken; a
-- recorded task that is no longer CANCELLED (revised since) stops its cascade.
-- KEYS[1] leases index, KEYS[2] scheduler hash (the freeze only)
-- ARGV[1] test clock (see now_ms), ARGV[2] key prefix (see task_lib.lua), ARGV[3] limit
-- Returns how many records and cancels it handled (0: nothing was pending), or
-- {'ERR', 'FROZEN', detail} (common.lua, check_not_frozen)
local frozen = check_not_frozen(KEYS[2])
if frozen then return frozen end
local now = now_ms(ARGV[1])
local limit = tonumber(ARGV[3])
local handled, cancelled = 0, 0
while handled < limit and cancelled < limit do
  local id = redis.call('SRANDMEMBER', CASCADES)
  if not id then break end
  redis.call('SREM', CASCADES, id)
  handled = handled + 1
  local origin = load_fields(task_key(id), {'task_id', 'state'})
  if origin and origin.state == 'CANCELLED' then
    cancelled = cancelled + cascade(KEYS[1], {id}, limit - cancelled, now)
  end
end
return handled + cancelled
