-- One step of the retention sweep (mirror of ledger.retention: why_kept, tombstone,
-- effect_tombstones; the SQL stores' expire_settled), atomic as every script, so gateways
-- sweeping at once never see half an expiry and never expire a task twice.
--   1. up to `limit` settled tasks due (due_at <= now - settled_ms), oldest first, from the
--      settled index (task_lib.lua keeps it): never a SCAN or KEYS, never the whole store;
--   2. each one: expire_one (why_kept): one still needed is moved to the back of the index
--      (due_at = now, looked at again settled_ms later), so a held task never stops the
--      sweep; one that may go is deleted with its effects and every index entry naming them,
--      and leaves tombstones (live until now + tombstone_ms);
--   3. up to `limit` keyed effects due (their keyed_settled score <= now - settled_ms) from
--      the keyed-settled index (effect_lib.lua's index_effect keeps it): expire_keyed
--      (why_kept_keyed): one still needed moves to the back (score = now), one that may go
--      is deleted with every index entry naming it and leaves an effect tombstone with no
--      task (an empty task_id, which an older gateway still reads);
--   4. up to `limit` task tombstones and `limit` effect tombstones past forget_at forgotten.
-- The events already in the feed stay (events_trim.lua trims it by count).
-- KEYS[1] settled index, KEYS[2] leases index, KEYS[3] tasks index, KEYS[4] effects index
-- (creation order), KEYS[5] effectId -> taskId hash, KEYS[6] prepared index, KEYS[7] unknown
-- index, KEYS[8] awaiting-approval index, KEYS[9] probe-due index, KEYS[10] task tombstones
-- index, KEYS[11] effect tombstones index, KEYS[12] keyed-settled index, KEYS[13] effect ids
-- index, KEYS[14] scheduler hash (the freeze only)
-- ARGV[1] test clock (see now_ms), ARGV[2] key prefix (see task_lib.lua), ARGV[3] settled_ms,
-- ARGV[4] tombstone_ms, ARGV[5] limit
-- Returns {examined (tasks and keyed effects), expired tasks, expired effects (with their
--          tasks and keyed), forgotten tombstones, reason, count, reason, count, ...} (the
--          tasks and keyed effects kept, by why_kept's and why_kept_keyed's reason), or
--          {'ERR', 'FROZEN', detail} (common.lua, check_not_frozen)
local frozen = check_not_frozen(KEYS[14])
if frozen then return frozen end
local settled, leases, tasks_index = KEYS[1], KEYS[2], KEYS[3]
local effects_order, effect_tasks = KEYS[4], KEYS[5]
local prepared, unknown, awaiting, probe_due = KEYS[6], KEYS[7], KEYS[8], KEYS[9]
local task_stones, effect_stones = KEYS[10], KEYS[11]
local keyed_index, effect_ids = KEYS[12], KEYS[13]
local now = now_ms(ARGV[1])
local settled_ms, tombstone_ms, limit = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local forget_at = now + tombstone_ms

-- Keys of other records, from the layout rendered from ledger/keys.py (`K`, task_lib.lua).
local effects_key, effect_tombstone_key = K.effects, K.effect_tombstone

-- What a decision and a deletion need of a task (the rest goes with the hash).
local TASK_FIELDS = {'task_id', 'state', 'revision', 'claim_generation', 'cancel_generation',
  'input_digest', 'queue', 'priority', 'ready_at', 'created_at', 'depends_on'}

-- Does a task that depends on `id` still exist? A dependent's new revision re-reads its
-- dependencies, so none may go before it. (An expired dependent took itself out of this set;
-- a member whose task is gone otherwise holds nothing.)
local function has_dependents(id)
  for _, d in ipairs(redis.call('SMEMBERS', dependents_key(id))) do
    if redis.call('EXISTS', task_key(d)) == 1 then return true end
  end
  return false
end

-- The task's effect records in creation order (createdAt, then effectId, the order every
-- store lists them in).
local function task_effects(id)
  local list = {}
  for i, raw in ipairs(redis.call('HVALS', effects_key(id))) do list[i] = cjson.decode(raw) end
  table.sort(list, function(a, b)
    local ca, cb = tonumber(a.created_at), tonumber(b.created_at)
    if ca ~= cb then return ca < cb end
    return a.effect_id < b.effect_id
  end)
  return list
end

-- Mirror of ledger.retention.why_kept: nil when the task and its effects may go, else why
-- not. effective() only turns a PREPARED past its deadline into UNKNOWN, and both are
-- 'unsettled_effect', so the stored state decides exactly as the effective one would.
local function why_kept(t, list)
  if not SETTLED_STATES[t.state] then return 'open' end
  if has_dependents(t.task_id) then return 'dependents' end
  for _, e in ipairs(list) do
    if e.state == 'PREPARED' or e.state == 'UNKNOWN' then return 'unsettled_effect' end
  end
  for _, e in ipairs(list) do
    if is_awaiting_approval(e) then return 'awaiting_approval' end
  end
  return nil
end

-- A tombstone hash (always every field of its kind, so HSET overwrites an older one whole),
-- gone by itself tombstone_ms from now (PEXPIRE, not
-- PEXPIREAT forget_at: the two are the same instant on the production clock, and under a test
-- clock, whose now may lie in Redis's past, the key would go at once; a reader compares
-- forget_at with the store's now anyway, so Redis's own expiry only frees the memory).
local function write_tombstone(key, fields, index, id)
  local flat = {}
  for k, v in pairs(fields) do
    flat[#flat + 1] = k
    flat[#flat + 1] = v
  end
  redis.call('HSET', key, unpack(flat))
  redis.call('PEXPIRE', key, math.max(tombstone_ms, 1))
  redis.call('ZADD', index, forget_at, id)
end

-- Delete a task that may go and everything that names it or its effects; leave its
-- tombstones (ledger.retention.tombstone, effect_tombstones). Returns how many effects went.
local function expire_task(t, list)
  local id = t.task_id
  redis.call('DEL', task_key(id), effects_key(id), dependents_key(id))
  for _, d in ipairs(str_list(t.depends_on)) do redis.call('SREM', dependents_key(d), id) end
  redis.call('ZREM', settled, id)
  redis.call('ZREM', tasks_index, id)
  redis.call('SREM', CASCADES, id)
  -- A settled task is in no lease or queue index (task_changed took it out as it settled);
  -- four cheap removals per task make sure nothing older is left naming it.
  redis.call('ZREM', leases, id)
  if t.queue then
    redis.call('ZREM', queue_key(t.queue, 'ready'), queue_member(t))
    redis.call('ZREM', queue_key(t.queue, 'held'), id)
    redis.call('ZREM', queue_key(t.queue, 'epochs'), id)
  end
  for _, e in ipairs(list) do
    local eid = e.effect_id
    redis.call('ZREM', effects_order, string.format('%015d', tonumber(e.created_at)) .. ':'
      .. eid .. ':' .. id)
    redis.call('HDEL', effect_tasks, eid)
    redis.call('ZREM', effect_ids, eid)
    -- The state indexes hold a record exactly as its state implies (index_effect keeps
    -- them), and why_kept let only COMMITTED and NOT_APPLIED-after-a-forward records through:
    -- those are in none, so there is nothing to remove per effect (the per-effect cost is
    -- what bounds a step's length). The rule is spelt out anyway, for any state.
    if e.state == 'PREPARED' then redis.call('ZREM', prepared, eid) end
    if e.state == 'UNKNOWN' then
      redis.call('SREM', unknown, eid)
      redis.call('ZREM', probe_due, eid)
    end
    if is_awaiting_approval(e) then redis.call('SREM', awaiting, eid) end
    write_tombstone(effect_tombstone_key(eid), {effect_id = eid, task_id = id,
      state = e.state, expired_at = s(now), forget_at = s(forget_at)}, effect_stones, eid)
  end
  -- (An absent generation is 0, as ledger.tasks.task_from_fields reads it.)
  write_tombstone(tombstone_key(id), {task_id = id, revision = t.revision,
    claim_generation = t.claim_generation or '0', cancel_generation = t.cancel_generation or '0',
    input_digest = t.input_digest, state = t.state, expired_at = s(now),
    forget_at = s(forget_at), effects = s(#list)}, task_stones, id)
  return #list
end

-- One task of the index: nil when it expired (and how many effects went), else the reason it
-- stays ('open' and a missing task only drop their stale entry: nothing to keep).
local function expire_one(id)
  local t = load_fields(task_key(id), TASK_FIELDS)
  if not t then
    redis.call('ZREM', settled, id)
    return 'open', 0
  end
  if not SETTLED_STATES[t.state] then
    redis.call('ZREM', settled, id)
    return 'open', 0
  end
  local list = task_effects(id)
  local reason = why_kept(t, list)
  if reason then
    redis.call('ZADD', settled, 'XX', now, id)
    return reason, 0
  end
  return nil, expire_task(t, list)
end

-- Mirror of ledger.retention.why_kept_keyed: nil when a keyed effect may go, else why not.
-- As in why_kept, the stored state decides as the effective one would.
local function why_kept_keyed(e)
  if e.state == 'PREPARED' or e.state == 'UNKNOWN' then return 'unsettled_effect' end
  if is_awaiting_approval(e) then return 'awaiting_approval' end
  return nil
end

-- One keyed effect of its index: nil when it expired, else the reason it stays ('gone' for an
-- entry whose record is missing: the entry goes, nothing is kept).
local function expire_keyed(id)
  local key = K.keyed_effect(id)
  local raw = redis.call('HGET', key, id)
  if not raw then
    redis.call('ZREM', keyed_index, id)
    return 'gone'
  end
  local e = cjson.decode(raw)
  local reason = why_kept_keyed(e)
  if reason then
    redis.call('ZADD', keyed_index, 'XX', now, id)
    return reason
  end
  redis.call('DEL', key)
  redis.call('ZREM', keyed_index, id)
  redis.call('ZREM', effects_order, string.format('%015d', tonumber(e.created_at)) .. ':'
    .. id .. ':')
  redis.call('ZREM', effect_ids, id)
  -- A record why_kept_keyed let through is in no state index (as in expire_task).
  write_tombstone(effect_tombstone_key(id), {effect_id = id, task_id = '', state = e.state,
    expired_at = s(now), forget_at = s(forget_at)}, effect_stones, id)
  return nil
end

-- Forget up to `limit` tombstones of one kind past forget_at (the index's score): the key
-- (if Redis has not expired it yet) and its index entry. A tombstone written again since has
-- its new forget_at as score, so a live one is never taken.
local function forget(index, key_of)
  local ids = redis.call('ZRANGEBYSCORE', index, '-inf', now, 'LIMIT', 0, limit)
  for _, id in ipairs(ids) do
    redis.call('DEL', key_of(id))
    redis.call('ZREM', index, id)
  end
  return #ids
end

local due = redis.call('ZRANGEBYSCORE', settled, '-inf', now - settled_ms, 'LIMIT', 0, limit)
local expired_tasks, expired_effects = 0, 0
local kept, reasons = {}, {}
-- Count one record kept, by why (ExpiryReport.kept, in the order reasons first appear).
local function keep(reason)
  if not kept[reason] then
    kept[reason] = 0
    reasons[#reasons + 1] = reason
  end
  kept[reason] = kept[reason] + 1
end
for _, id in ipairs(due) do
  local reason, effects = expire_one(id)
  if reason == nil then
    expired_tasks = expired_tasks + 1
    expired_effects = expired_effects + effects
  elseif reason ~= 'open' then
    keep(reason)
  end
end
local keyed_due = redis.call('ZRANGEBYSCORE', keyed_index, '-inf', now - settled_ms, 'LIMIT', 0,
  limit)
for _, id in ipairs(keyed_due) do
  local reason = expire_keyed(id)
  if reason == nil then
    expired_effects = expired_effects + 1
  elseif reason ~= 'gone' then
    keep(reason)
  end
end
local forgotten = forget(task_stones, tombstone_key) + forget(effect_stones, effect_tombstone_key)

local out = {#due + #keyed_due, expired_tasks, expired_effects, forgotten}
for _, reason in ipairs(reasons) do
  out[#out + 1] = reason
  out[#out + 1] = kept[reason]
end
return out
