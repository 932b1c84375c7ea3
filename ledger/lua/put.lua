-- Create a task or open a new revision (mirror of ledger.tasks.put, with the dependency rules
-- of ledger.sql_steps.put_task: check the new dependencies, keep the dependents sets, and send
-- the open dependents of a committed task's new revision back to WAITING).
-- KEYS[1] task hash, KEYS[2] leases index, KEYS[3] tasks index (every task id, score 0),
-- KEYS[4] scheduler hash (the freeze only)
-- ARGV[1] test clock (see now_ms), ARGV[2] key prefix (see task_lib.lua), ARGV[3] taskId,
-- ARGV[4] inputDigest, ARGV[5] maxRuntimeMs or '', ARGV[6] queue or '' (not given),
-- ARGV[7] priority or '' (not given), ARGV[8] dependsOn as a JSON array, duplicates removed,
-- or '' (not given), ARGV[9] most dependents a task may have, ARGV[10] most tasks the cycle
-- check walks (ledger.tasks.MAX_GRAPH_VISITS)
-- Also reads (on create) and deletes the task's tombstone and its entry in the tombstones'
-- index (task_lib.lua: tombstone_key, TASK_TOMBSTONES), and keeps the settled index
-- (task_changed).
-- Returns {'CREATED'|'REVISED'|'UNCHANGED', fields...} (with `discarded` when attempts were
-- superseded), {'EXPIRED', tombstone fields...} when the task expired and this is its input
-- again (the gateway raises ledger.tasks.expired_task from the fields, so the text is the
-- model's), or {'ERR', code, detail} (FROZEN: common.lua, check_not_frozen)
local frozen = check_not_frozen(KEYS[4])
if frozen then return frozen end
local task_id = ARGV[3]
local now = now_ms(ARGV[1])
local found = load_hash(KEYS[1])
if found and found.input_digest == ARGV[4] then
  return answer('UNCHANGED', found)
end

-- No record: the task may have expired (ledger.retention). Its tombstone, while live
-- (forget_at > now: one past it counts as absent even before the sweep or Redis's own
-- expiry removed it), is the `tombstone` of ledger.tasks.put: the same input is refused (the
-- work was done), a new one creates the task at the next revision with its claim and cancel
-- generations continuing, so neither effectIds nor fencing tokens repeat.
local stone
if not found then
  local flat = redis.call('HGETALL', tombstone_key(task_id))
  if #flat > 0 then
    stone = {}
    for i = 1, #flat, 2 do stone[flat[i]] = flat[i + 1] end
    if tonumber(stone.forget_at) <= now then stone = false end
  end
  if stone and stone.input_digest == ARGV[4] then return answer('EXPIRED', stone) end
end

local before_deps = {}
if found then before_deps = str_list(found.depends_on) end
local deps_text
if ARGV[8] ~= '' then deps_text = ARGV[8] elseif found then deps_text = found.depends_on end
local deps_now = str_list(deps_text)
local had = {}
for _, d in ipairs(before_deps) do had[d] = true end
local listed = {}
local added = {}
for _, d in ipairs(deps_now) do
  listed[d] = true
  if not had[d] then added[#added + 1] = d end
end

-- ledger.tasks.check_dependencies, with the records the model's `deps` would hold.
local deps = {}
for _, d in ipairs(deps_now) do
  if d == task_id then return err('BAD_REQUEST', 'dependsOn: ' .. d .. ' is this task (a cycle)') end
  local rec = load_fields(task_key(d), {'task_id', 'state', 'commit_id', 'commit_result_digest'})
  if not rec then return err('BAD_REQUEST', 'dependsOn: no task ' .. d) end
  if rec.state == 'CANCELLED' then
    return err('BAD_REQUEST', 'dependsOn: ' .. d .. ' is cancelled (revise it first)')
  end
  deps[d] = rec
end

-- The cycle check (mirror of ledger.task_graph.check_no_cycle): follow depends_on from the added
-- dependencies, breadth first, each task once; only a task that exists can close a cycle.
if found and #added > 0 then
  local limit = tonumber(ARGV[10])
  local seen, count = {}, 0
  local frontier, head = {}, 1
  for i, d in ipairs(added) do frontier[i] = d end
  while head <= #frontier do
    local current = frontier[head]
    head = head + 1
    if not seen[current] then
      seen[current] = true
      count = count + 1
      if count > limit then
        return err('BAD_REQUEST', 'dependsOn: the dependency graph is too large to check (over '
          .. s(limit) .. ' tasks)')
      end
      for _, d in ipairs(str_list(redis.call('HGET', task_key(current), 'depends_on'))) do
        if d == task_id then
          return err('BAD_REQUEST', 'dependsOn: ' .. current .. ' depends on ' .. task_id
            .. ' (a cycle)')
        end
        frontier[#frontier + 1] = d
      end
    end
  end
end

local max_dependents = tonumber(ARGV[9])
for _, d in ipairs(added) do
  if redis.call('SCARD', dependents_key(d)) >= max_dependents then
    return err('BAD_REQUEST', 'dependsOn: ' .. d .. ' already has ' .. s(max_dependents)
      .. ' dependents')
  end
end

-- ledger.tasks._provenance and _open_state.
local commits = {}
for _, d in ipairs(deps_now) do
  local rec = deps[d]
  if rec.state == 'COMMITTED' and rec.commit_id then
    commits[#commits + 1] = {d, rec.commit_id, rec.commit_result_digest}
  end
end
local state = 'WAITING'
if #commits == #deps_now then state = 'READY' end
if deps_text == '' or #deps_now == 0 then deps_text = nil end

local t
local status
local before = before_of(found)
if not found then
  status = 'CREATED'
  t = {task_id = task_id, state = state, revision = '1', input_digest = ARGV[4],
       claim_generation = '0', cancel_generation = '0', created_at = s(now), updated_at = s(now),
       ready_at = s(now), depends_on = deps_text, dep_commits = dep_commits_text(commits)}
  if stone then
    t.revision = s(tonumber(stone.revision) + 1)
    t.claim_generation = stone.claim_generation
    t.cancel_generation = stone.cancel_generation
  end
  if stone ~= nil then
    -- The task exists again: its tombstone (live and used, or dead) means nothing any more.
    redis.call('DEL', tombstone_key(task_id))
    redis.call('ZREM', TASK_TOMBSTONES, task_id)
  end
  if ARGV[5] ~= '' then t.max_runtime_ms = ARGV[5] end
  if ARGV[6] ~= '' then t.queue = ARGV[6] end
  if ARGV[7] ~= '' and tonumber(ARGV[7]) ~= 0 then t.priority = ARGV[7] end
  redis.call('ZADD', KEYS[3], 0, task_id)
else
  status = 'REVISED'
  t = found
  if t.state == 'CLAIMED' then discard(t, 'superseded') end
  t.state = state
  t.revision = s(tonumber(t.revision) + 1)
  t.input_digest = ARGV[4]
  if ARGV[5] ~= '' then t.max_runtime_ms = ARGV[5] end
  t.commit_id = nil
  t.commit_attempt_id = nil
  t.commit_generation = nil
  t.commit_result_digest = nil
  t.committed_at = nil
  t.commit_result = nil
  t.updated_at = s(now)
  t.ready_at = s(now)
  if ARGV[6] ~= '' then t.queue = ARGV[6] end
  if ARGV[7] ~= '' then
    if tonumber(ARGV[7]) ~= 0 then t.priority = ARGV[7] else t.priority = nil end
  end
  t.depends_on = deps_text
  t.dep_commits = dep_commits_text(commits)
  t.attempt_cost = nil
end
save_hash(KEYS[1], t)
task_changed(KEYS[2], before, t)
for _, d in ipairs(before_deps) do
  if not listed[d] then redis.call('SREM', dependents_key(d), task_id) end
end
for _, d in ipairs(added) do redis.call('SADD', dependents_key(d), task_id) end

-- A new revision of a committed task: its open dependents lose that provenance and wait again.
if before and before.state == 'COMMITTED' then
  update_dependents(KEYS[2], task_id, function(d) return dependency_revised(d, task_id, now) end)
end
return task_answer(status, t)
