-- Helpers for the task scripts (prepended after common.lua): put, claim, claim_next, renew,
-- release, commit, cancel. Mirrors of the task-flow rules of ledger/tasks.py (queues,
-- dependencies, cost, discarded attempts) and of the change feed (ledger/events.py).
--
-- Every script with this library receives the key prefix as ARGV[2] (after the test clock),
-- and builds the keys of other tasks, queues and the event stream from it with `K`, the key
-- layout rendered from ledger/keys.py just before this file (ledger.keys.lua_key_helpers;
-- no Lua file retypes a key). That is what lets one script follow a dependency or a queue to
-- tasks it was not given in KEYS. On a Redis Cluster that is one bucket's keys, in one slot
-- (ledger/buckets.py): safe as long as the slot does not move under the script, which the
-- freeze below sees to.

local task_key, dependents_key = K.task, K.dependents
local QUEUE_KEYS = {ready = K.queue_ready, held = K.queue_held, epochs = K.queue_epochs}
local function queue_key(q, kind) return QUEUE_KEYS[kind](q) end
-- On a Redis Cluster the prefix is a bucket's, with its hash tag in braces (key prefixes of
-- one Redis cannot contain braces: gateway.config): a READY task then also owes its queue's
-- hint this bucket (K.queue_owed, which ClusterStore moves into the hint after the step).
local QUEUE_OWED = nil
if string.find(P, '{', 1, true) then QUEUE_OWED = K.queue_owed end
local EVENTS = K.events
-- Set of cancelled tasks whose dependents a cascade has still to visit (continue_cascades).
local CASCADES = K.cascades
-- Retention (ledger.retention): the settled index (taskId by due_at, kept by task_changed),
-- a task's tombstone and the tombstones' forget_at index.
local SETTLED = K.settled
local tombstone_key = K.tombstone
local TASK_TOMBSTONES = K.task_tombstones

-- --- the bucket's scheduler copy (ledger.scheduler_copies) ------------------------------------

-- The freeze (a Redis Cluster slot migration): common.lua's frozen_refusal and
-- check_not_frozen.

-- The bucket's scheduler copy as a task step reads it, in one HMGET: the epoch (default 1),
-- the operator's pause, the bump's barrier (ledger.scheduler_copies.Copy: barrier_target and
-- barrier_until_ms, both or neither) and the freeze.
local function scheduler_copy(key)
  local v = redis.call('HMGET', key, 'epoch', 'paused', 'barrier_target', 'barrier_until_ms',
    'frozen')
  return {epoch = tonumber(v[1] or '1'), paused = v[2] == '1', barrier_target = num(v[3]),
          barrier_until_ms = num(v[4]), frozen = v[5] ~= false and v[5] ~= ''}
end

-- The epoch a renew or a commit is checked against, or nil and the FROZEN refusal.
local function step_epoch(key)
  local copy = scheduler_copy(key)
  if copy.frozen then return nil, frozen_refusal() end
  return copy.epoch, nil
end

-- Mirror of ledger.scheduler_copies.claim_admission, with the freeze: what a claim (by id or
-- from a queue) meets in its bucket before anything else is read. The operator's pause first
-- (CLAIMS_PAUSED, the answer a caller can act on; ledger.tasks.claim's words), then a frozen
-- bucket, then a barrier that still holds (barrier_holds: now before its deadline), answered
-- BARRIER with the bump's target and how long it holds at most: never a client's answer, the
-- cluster store retries the claim (RedisStore maps it to errors.BumpBarrier). Returns the
-- epoch to claim under (Admit), or nil and the refusal.
local function claim_admission(key, now)
  local copy = scheduler_copy(key)
  if copy.paused then
    return nil, err('CLAIMS_PAUSED', 'claims are paused by an operator; retry later')
  end
  if copy.frozen then return nil, frozen_refusal() end
  if copy.barrier_until_ms ~= nil and now < copy.barrier_until_ms then
    return nil, err('BARRIER', 'an epoch bump to ' .. s(copy.barrier_target) .. ' is in progress',
      'target', s(copy.barrier_target), 'retryAfterMs', s(copy.barrier_until_ms - now))
  end
  return copy.epoch, nil
end

-- States the dependency rules change (ledger.tasks._OPEN).
local OPEN = {WAITING = true, READY = true, CLAIMED = true}
-- States retention may delete, the ones the settled index holds
-- (ledger.retention.SETTLED_TASK_STATES).
local SETTLED_STATES = {COMMITTED = true, CANCELLED = true}

-- --- JSON ----------------------------------------------------------------------------------

local function json_str(x)
  return cjson.encode(x)
end

-- A number as JSON that reads back as the same double (cjson keeps only 14 digits).
local function json_num(x)
  return string.format('%.17g', x)
end

-- A JSON array (depends_on, dep_commits), as a Lua list; {} for nil, false (a missing field
-- as HGET answers it) or ''.
local function str_list(text)
  if not text or text == '' then return {} end
  return cjson.decode(text)
end

-- --- cost (ledger.tasks.add_cost, cost_to_json) ----------------------------------------------

-- The cost object (unit -> number) as JSON, units sorted; nil when empty (absent field).
local function cost_encode(c)
  local units = {}
  for unit in pairs(c) do units[#units + 1] = unit end
  if #units == 0 then return nil end
  table.sort(units)
  local parts = {}
  for i, unit in ipairs(units) do parts[i] = json_str(unit) .. ':' .. json_num(c[unit]) end
  return '{' .. table.concat(parts, ',') .. '}'
end

-- Mirror of add_cost: the stored attempt_cost text plus a request's cost (JSON object text,
-- '' for none). Returns the new field value (nil when empty).
local function add_cost(stored, more)
  if more == nil or more == '' then return stored end
  local extra = cjson.decode(more)
  if next(extra) == nil then return stored end
  local sums = {}
  if stored then sums = cjson.decode(stored) end
  for unit, value in pairs(extra) do sums[unit] = (sums[unit] or 0) + value end
  return cost_encode(sums)
end

-- --- discarded attempts (Task.discarded: never stored, answered as the pseudo-field) ---------

local DISCARDS = {}

-- Mirror of ledger.tasks._discard: the attempt `t` holds, with what it reported spending.
local function discard(t, reason)
  DISCARDS[#DISCARDS + 1] = '[' .. json_str(t.task_id) .. ',' .. json_str(t.attempt_id) .. ',"'
    .. reason .. '",' .. (t.attempt_cost or '{}') .. ']'
end

-- The answer of a task step: the task's fields and, when the step threw attempts away, the
-- pseudo-field `discarded` (JSON array of [taskId, attemptId, reason, cost]). Call it after
-- save_hash: the field must never reach the hash.
local function task_answer(status, t)
  local out = answer(status, t)
  if #DISCARDS > 0 then
    out[#out + 1] = 'discarded'
    out[#out + 1] = '[' .. table.concat(DISCARDS, ',') .. ']'
  end
  return out
end

-- --- the change feed -----------------------------------------------------------------------

-- What the queue index and the change feed need to know of a task before a step changed it
-- (nil: the task did not exist).
local function before_of(t)
  if not t then return nil end
  return {task_id = t.task_id, state = t.state, revision = t.revision,
          claim_generation = t.claim_generation, queue = t.queue, priority = t.priority,
          ready_at = t.ready_at, created_at = t.created_at}
end

-- One event (ledger.events.task_event) when a step changed the task's state, revision or
-- claim generation (or created it), in the same step, as the SQL stores' triggers do.
local function task_event(before, t)
  if before and before.state == t.state and before.revision == t.revision
      and before.claim_generation == t.claim_generation then
    return
  end
  local queue = 'null'
  if t.queue then queue = json_str(t.queue) end
  redis.call('XADD', EVENTS, '*', 'e', '{"type":"task","taskId":' .. json_str(t.task_id)
    .. ',"state":"' .. t.state .. '","queue":' .. queue .. ',"revision":' .. t.revision
    .. ',"claimGeneration":' .. t.claim_generation .. ',"at":' .. t.updated_at .. '}')
end

-- --- queues --------------------------------------------------------------------------------

-- The ready index's member of a task (ledger.tasks.queue_order, as text that sorts the same
-- way): %07d(1_000_000 - priority):%015d(ready_at or created_at):taskId.
local function queue_member(v)
  return string.format('%07d:%015d:', 1000000 - (num(v.priority) or 0),
    tonumber(v.ready_at or v.created_at)) .. v.task_id
end

-- Put a task in the indexes of its queue its state implies: READY in `ready` (all scores 0,
-- lexical order = queue_order); CLAIMED in `held` by leaseExpiresAt and in `epochs` by
-- claimEpoch (claim_next moves the expired and old-epoch ones into `ready`).
local function queue_add(t)
  if not t.queue then return end
  if t.state == 'READY' then
    redis.call('ZADD', queue_key(t.queue, 'ready'), 0, queue_member(t))
    if QUEUE_OWED then redis.call('SADD', QUEUE_OWED, t.queue) end
  elseif t.state == 'CLAIMED' then
    redis.call('ZADD', queue_key(t.queue, 'held'), tonumber(t.lease_expires_at), t.task_id)
    redis.call('ZADD', queue_key(t.queue, 'epochs'), tonumber(t.claim_epoch), t.task_id)
  end
end

-- Keep the queue indexes in step with a task a step changed (before: before_of the task as
-- read). A CLAIMED task may sit in `ready` (claim_next moved it there once it became
-- claimable), so leaving CLAIMED removes it from all three.
local function index_queue(before, t)
  if before and before.queue then
    local q = before.queue
    if before.state == 'READY' or before.state == 'CLAIMED' then
      redis.call('ZREM', queue_key(q, 'ready'), queue_member(before))
    end
    if before.state == 'CLAIMED' then
      redis.call('ZREM', queue_key(q, 'held'), before.task_id)
      redis.call('ZREM', queue_key(q, 'epochs'), before.task_id)
    end
  end
  queue_add(t)
end

-- --- the settled index (ledger.retention) ---------------------------------------------------

-- Keep the settled index in step with a task a step changed: a task entering COMMITTED or
-- CANCELLED is added with due_at = its updated_at (the step's now); one leaving them (a new
-- revision) is removed. A step that leaves a settled task settled writes nothing, so its
-- due_at stays (and the retention sweep's "kept: due_at = now" is not undone), and a step
-- between open states writes nothing either: claim, renew, release and the hot path pay no
-- command for the index, commit, cancel and put at most one.
local function index_settled(before, t)
  local was = before ~= nil and SETTLED_STATES[before.state] ~= nil
  local is = SETTLED_STATES[t.state] ~= nil
  if is and not was then
    redis.call('ZADD', SETTLED, tonumber(t.updated_at), t.task_id)
  elseif was and not is then
    redis.call('ZREM', SETTLED, t.task_id)
  end
end

-- Every index and the feed, after a step changed task `t` (before: before_of it as read).
-- The one place a task's state is written to its indexes, so the settled index cannot miss
-- a step (the dependents a commit, revision or cancel changes go through save_task to here).
local function task_changed(leases, before, t)
  index_lease(leases, t)
  index_queue(before, t)
  index_settled(before, t)
  task_event(before, t)
end

-- Save another task a step changed (a dependent) and keep its indexes and the feed.
local function save_task(leases, before, t)
  save_hash(task_key(t.task_id), t)
  task_changed(leases, before, t)
end

-- --- claims --------------------------------------------------------------------------------

-- The dependencies of a WAITING task that have not committed (depends_on order).
local function pending_deps(t)
  local done = {}
  for _, c in ipairs(str_list(t.dep_commits)) do done[c[1]] = true end
  local pending = {}
  for _, d in ipairs(str_list(t.depends_on)) do
    if not done[d] then pending[#pending + 1] = d end
  end
  return pending
end

-- Mirror of ledger.tasks.is_claimable.
local function is_claimable(t, epoch, now)
  if t.state == 'READY' then return true end
  return t.state == 'CLAIMED' and (num(t.claim_epoch) ~= epoch or t.lease_expires_at == nil
    or now >= tonumber(t.lease_expires_at))
end

-- The part of ledger.tasks.claim after the request checks (paused, no such task, epoch,
-- expectedRevision): the state checks, then the claim itself, written into `t`. Returns an
-- error reply or nil.
local function claim_task(t, now, epoch, owner, ttl_ms, attempt_id, max_ttl, default_runtime,
                          principal)
  if t.state == 'COMMITTED' then return err('ALREADY_COMMITTED') end
  if t.state == 'CANCELLED' then return err('CANCELLED') end
  if t.state == 'WAITING' then
    local pending = pending_deps(t)
    local named = {}
    for i = 1, math.min(#pending, 10) do named[i] = pending[i] end
    local detail = 'waiting for dependencies: ' .. table.concat(named, ', ')
    if #pending > 10 then detail = detail .. ' and ' .. s(#pending - 10) .. ' more' end
    return err('DEPENDENCIES_PENDING', detail)
  end
  if t.state == 'CLAIMED' and num(t.claim_epoch) == epoch and t.lease_expires_at
      and now < tonumber(t.lease_expires_at) then
    return err('CLAIMED', 'held until leaseExpiresAt ' .. t.lease_expires_at,
      'leaseExpiresAt', t.lease_expires_at, 'retryAfterMs', s(tonumber(t.lease_expires_at) - now))
  end
  local runtime = num(t.max_runtime_ms) or default_runtime
  local ttl = math.min(ttl_ms, max_ttl, runtime)
  if t.state == 'CLAIMED' then
    local reason = 'expired'
    if num(t.claim_epoch) ~= epoch then reason = 'epoch' end
    discard(t, reason)
    t.previous_lease_expires_at = t.lease_expires_at
  else
    t.previous_lease_expires_at = nil
  end
  t.attempt_cost = nil
  t.state = 'CLAIMED'
  t.claim_generation = s(tonumber(t.claim_generation) + 1)
  t.attempt_id = attempt_id
  t.owner = owner
  if principal ~= '' then t.principal = principal else t.principal = nil end
  t.lease_expires_at = s(now + ttl)
  t.attempt_started_at = s(now)
  t.claim_epoch = s(epoch)
  t.claim_revision = t.revision
  t.updated_at = s(now)
  return nil
end

-- --- dependencies --------------------------------------------------------------------------

-- Members of a set in sorted order (the SQL stores walk dependents ORDER BY dependent_id, and
-- the order shows in `discarded`).
local function sorted_members(key)
  local ids = redis.call('SMEMBERS', key)
  table.sort(ids)
  return ids
end

-- The JSON text of dep_commits ([[taskId, commitId, resultDigest], ...]); nil when empty.
local function dep_commits_text(list)
  if #list == 0 then return nil end
  local parts = {}
  for i, c in ipairs(list) do
    parts[i] = '[' .. json_str(c[1]) .. ',' .. json_str(c[2]) .. ',' .. json_str(c[3]) .. ']'
  end
  return '[' .. table.concat(parts, ',') .. ']'
end

-- Mirror of ledger.tasks.dependency_committed, written into `d`: true when it changed.
local function dependency_committed(d, dep, now)
  if not OPEN[d.state] or dep.commit_id == nil then return false end
  local depends_on = str_list(d.depends_on)
  local listed = false
  for _, id in ipairs(depends_on) do
    if id == dep.task_id then listed = true end
  end
  if not listed then return false end
  local have = {}
  for _, c in ipairs(str_list(d.dep_commits)) do
    if c[1] == dep.task_id then return false end
    have[c[1]] = c
  end
  have[dep.task_id] = {dep.task_id, dep.commit_id, dep.commit_result_digest}
  local list = {}
  for _, id in ipairs(depends_on) do
    if have[id] then list[#list + 1] = have[id] end
  end
  d.dep_commits = dep_commits_text(list)
  if d.state == 'WAITING' and #list == #depends_on then
    d.state = 'READY'
    d.ready_at = s(now)
  end
  d.updated_at = s(now)
  return true
end

-- Mirror of ledger.tasks.dependency_revised, written into `d`: true when it changed.
local function dependency_revised(d, dep_id, now)
  if not OPEN[d.state] then return false end
  local kept, found = {}, false
  for _, c in ipairs(str_list(d.dep_commits)) do
    if c[1] == dep_id then found = true else kept[#kept + 1] = c end
  end
  if not found then return false end
  if d.state == 'CLAIMED' then discard(d, 'superseded') end
  d.state = 'WAITING'
  d.dep_commits = dep_commits_text(kept)
  d.attempt_cost = nil
  d.updated_at = s(now)
  return true
end

-- Mirror of ledger.tasks.cancel for a task that is not COMMITTED or CANCELLED.
local function cancel_open(t, now)
  if t.state == 'CLAIMED' then discard(t, 'cancelled') end
  t.state = 'CANCELLED'
  t.cancel_generation = s(tonumber(t.cancel_generation) + 1)
  t.updated_at = s(now)
end


-- Apply `rule` (a dependency rule of ledger/tasks.py, as a function of the dependent's record
-- that changes it in place and says whether it did) to every dependent of `task_id`, in task
-- id order as the SQL stores do, and save the ones it changed (mirror of
-- ledger.task_graph.release_dependents and revise_dependents).
local function update_dependents(leases, task_id, rule)
  for _, id in ipairs(sorted_members(dependents_key(task_id))) do
    local key = task_key(id)
    local d = load_hash(key)
    if d then
      local d_before = before_of(d)
      if rule(d) then
        save_task(leases, d_before, d)
      else
        loaded[key] = nil
      end
    end
  end
end

-- Cancel the open dependents of the (cancelled) tasks in `frontier`, breadth first, each once
-- (mirror of ledger.task_graph.cancel_cascade): a dependent that changed passes the cancel on to its own
-- dependents; a committed or already cancelled one stops it. Once `limit` tasks were
-- cancelled, the tasks whose dependents are still to be visited go to CASCADES.
-- Returns how many it cancelled.
local function cascade(leases, frontier, limit, now)
  local cancelled, head = 0, 1
  while head <= #frontier and cancelled < limit do
    local current = frontier[head]
    head = head + 1
    for _, id in ipairs(sorted_members(dependents_key(current))) do
      local key = task_key(id)
      local d = load_hash(key)
      if d and OPEN[d.state] then
        local d_before = before_of(d)
        cancel_open(d, now)
        save_task(leases, d_before, d)
        cancelled = cancelled + 1
        frontier[#frontier + 1] = id
      else
        loaded[key] = nil
      end
    end
  end
  for i = head, #frontier do redis.call('SADD', CASCADES, frontier[i]) end
  return cancelled
end
