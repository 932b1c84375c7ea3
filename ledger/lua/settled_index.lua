-- The one-time backfill of the settled index (RedisStore._index_settled): a store written
-- before the index existed has settled tasks it does not hold, which retention would never
-- find. One batch of the tasks index (every task id, lexical order) per run, so no run blocks
-- Redis for long and no SCAN is needed beyond the tasks index's own one-time backfill. Each
-- task's state is read inside the step that indexes it, so a task revised meanwhile is never
-- indexed as settled; NX keeps the due_at of a task task_lib.lua indexed (or the sweep moved)
-- already.
-- KEYS[1] tasks index, KEYS[2] settled index, KEYS[3] scheduler hash (the freeze only)
-- ARGV[1] test clock (unused), ARGV[2] key prefix (see task_lib.lua), ARGV[3] the last task
-- id of the previous batch ('' to start), ARGV[4] batch size
-- Returns {the last task id of this batch ('' when it was empty), how many it read,
--          how many it added}, or {'ERR', 'FROZEN', detail} (common.lua, check_not_frozen)
local frozen = check_not_frozen(KEYS[3])
if frozen then return frozen end
local start = '-'
if ARGV[3] ~= '' then start = '(' .. ARGV[3] end
local ids = redis.call('ZRANGEBYLEX', KEYS[1], start, '+', 'LIMIT', 0, tonumber(ARGV[4]))
local added = 0
for _, id in ipairs(ids) do
  local v = redis.call('HMGET', task_key(id), 'state', 'updated_at')
  if v[1] and SETTLED_STATES[v[1]] then
    -- due_at = updated_at: when a settled task last changed is when it settled.
    added = added + redis.call('ZADD', KEYS[2], 'NX', tonumber(v[2]), id)
  end
end
return {ids[#ids] or '', #ids, added}
