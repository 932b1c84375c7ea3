-- Helpers for the effect scripts (prepended after common.lua). An effect record is a flat
-- map of strings, stored cjson-encoded as one field of the task's effects hash (a keyed
-- effect's: of its own one-field hash, ledger.keys.Keys.keyed_effect); attempt i
-- lives in fields a<i>_attempt_id, a<i>_claim_generation, a<i>_started_at, a<i>_ended_at,
-- a<i>_outcome, a<i>_reason (ledger.effects.effect_to_fields).

local DEADLINE_REASON = 'deadline passed'

-- Mirror of ledger.effects.is_overdue: a PREPARED past its deadline.
local function is_overdue(e, now)
  return e.state == 'PREPARED' and e.deadline_at ~= nil and now >= tonumber(e.deadline_at)
end

-- Mirror of ledger.effects.is_awaiting_approval: NOT_APPLIED with no attempts, or holding an
-- approval.
local function is_awaiting_approval(e)
  return e.state == 'NOT_APPLIED' and (e.attempt_count == '0' or e.approval_digest ~= nil)
end

-- Mirror of ledger.effects.sent_nothing (SENT_NOTHING_PREFIXES): the forward that ended with
-- this reason certainly sent nothing.
local SENT_NOTHING_PREFIXES = {'connect failed', 'never sent', 'never forwarded'}
local function sent_nothing(reason)
  if reason == nil then return false end
  for _, prefix in ipairs(SENT_NOTHING_PREFIXES) do
    if string.sub(reason, 1, #prefix) == prefix then return true end
  end
  return false
end

-- Mirror of ledger.effects._approval_after: the approval a forward went under is used up
-- unless the effect is NOT_APPLIED and the forward certainly sent nothing.
local function approval_after(e, state, reason)
  if state == 'NOT_APPLIED' and sent_nothing(reason) then return end
  e.approval_digest = nil
  e.approval_by = nil
  e.approval_at = nil
  e.approval_expires_at = nil
end

-- Mirror of ledger.effects.effective: a PREPARED past its deadline reads as UNKNOWN.
-- Returns true when it changed the record.
local function expire_effect(e, now)
  if is_overdue(e, now) then
    local p = 'a' .. s(tonumber(e.attempt_count) - 1) .. '_'
    e[p .. 'ended_at'] = e.deadline_at
    e[p .. 'outcome'] = 'UNKNOWN'
    e[p .. 'reason'] = DEADLINE_REASON
    e.state = 'UNKNOWN'
    e.deadline_at = nil
    approval_after(e, 'UNKNOWN', DEADLINE_REASON)
    e.updated_at = s(now)
    return true
  end
  return false
end

-- Mirror of ledger.effects._state_after: once an attempt since the last settlement
-- (settled_attempts) ended UNKNOWN, a later attempt's NOT_APPLIED leaves the effect UNKNOWN.
local function state_after(e, seq, outcome)
  if outcome ~= 'NOT_APPLIED' then return outcome end
  for i = tonumber(e.settled_attempts or '0'), seq - 1 do
    if e['a' .. s(i) .. '_outcome'] == 'UNKNOWN' then return 'UNKNOWN' end
  end
  return outcome
end

-- The effect indexes, from the keys a script received (in the order redis_store.py passes
-- them: prepared zset, unknown set, awaiting set, probe-due zset, the event stream, then the
-- keyed indexes (RedisStore._keyed_indexes): the keyed-settled zset, the keyed-prepared zset
-- and the keyed-unknown set, which only a step that may write a keyed record receives: nil
-- for the leased hot path, whose records never enter them). Each effect script builds this
-- once from its own KEYS and hands it to index_effect / save_effect.
local function effect_indexes(prepared, unknown, awaiting, probe_due, events, keyed_settled,
                              keyed_prepared, keyed_unknown)
  return {prepared = prepared, unknown = unknown, awaiting = awaiting, probe_due = probe_due,
          events = events, keyed_settled = keyed_settled, keyed_prepared = keyed_prepared,
          keyed_unknown = keyed_unknown}
end

-- Mirror of ledger.effects.keyed_settled: a keyed effect retention may count down
-- (COMMITTED, or NOT_APPLIED and not awaiting an approval).
local function keyed_settled(e)
  if e.idempotency_key == nil then return false end
  if e.state == 'COMMITTED' then return true end
  return e.state == 'NOT_APPLIED' and not is_awaiting_approval(e)
end

-- One event (ledger.events.effect_event) for a record whose state a step changed (or that it
-- created), in the same step: one XADD, the only write the change feed adds to a fenced call.
local function effect_event(index, e)
  redis.call('XADD', index.events, '*', 'e', '{"type":"effect","effectId":'
    .. cjson.encode(e.effect_id) .. ',"taskId":' .. cjson.encode(e.task_id) .. ',"state":"'
    .. e.state .. '","downstream":' .. cjson.encode(e.downstream) .. ',"at":' .. e.updated_at
    .. '}')
end

-- Where a record stood in the indexes before a step: its state and whether it awaited an
-- approval. NEW_RECORD is a record that did not exist (so it was in no index).
local NEW_RECORD = {state = '', awaiting = false}
-- A PREPARED record (one a gateway holds from its prepare, complete.lua).
local HELD_RECORD = {state = 'PREPARED', awaiting = false}
local function index_state(e)
  return {state = e.state, awaiting = is_awaiting_approval(e)}
end

-- Keep the indexes in step with one record. The prepared zset is scored by the deadline, so
-- "score <= now" is ledger.effects.is_overdue (lua/gauges.lua, RedisStore.unsettled_effects);
-- the probe-due zset is scored by next_probe_at, 0 for never probed
-- (ledger.queries.is_probe_due); the awaiting set is ledger.effects.is_awaiting_approval.
-- prior (index_state of the record before the step, NEW_RECORD for a new one) lets a step
-- skip the removals from indexes the record was not in: every script that writes a record
-- keeps its memberships, so the record as read was in exactly the indexes its state implies,
-- and a removal of a non-member changes nothing. (Each skipped call is ~2-3 us of Redis
-- CPU: a fenced call's two steps used to make eight index calls, now two.) prior = nil (the
-- compare-and-set path, off the hot path) writes every membership, which also repairs any
-- drift. A keyed record (never a leased one) is also in the keyed-prepared zset and the
-- keyed-unknown set exactly while it is in prepared and unknown, so lua/gauges.lua counts
-- the keyed UNKNOWN effects (ledger.queries.Gauges.unknown_keyed_effects) from the indexes
-- alone, and a leased step touches none of the keyed keys.
local function index_effect(index, e, prior)
  local id = e.effect_id
  local any = prior == nil
  local keyed = e.idempotency_key ~= nil
  if e.state == 'PREPARED' then
    redis.call('ZADD', index.prepared, tonumber(e.deadline_at), id)
    if keyed then redis.call('ZADD', index.keyed_prepared, tonumber(e.deadline_at), id) end
  elseif any or prior.state == 'PREPARED' then
    redis.call('ZREM', index.prepared, id)
    if keyed then redis.call('ZREM', index.keyed_prepared, id) end
  end
  if e.state == 'UNKNOWN' then
    redis.call('SADD', index.unknown, id)
    if keyed then redis.call('SADD', index.keyed_unknown, id) end
    if e.next_probe_at then
      redis.call('ZADD', index.probe_due, tonumber(e.next_probe_at), id)
    else
      -- NX: a reconciler may have parked it (a downstream without a probe).
      redis.call('ZADD', index.probe_due, 'NX', 0, id)
    end
  elseif any or prior.state == 'UNKNOWN' then
    redis.call('SREM', index.unknown, id)
    if keyed then redis.call('SREM', index.keyed_unknown, id) end
    redis.call('ZREM', index.probe_due, id)
  end
  if is_awaiting_approval(e) then
    if any or not prior.awaiting then redis.call('SADD', index.awaiting, id) end
  elseif any or prior.awaiting then
    redis.call('SREM', index.awaiting, id)
  end
  -- A keyed record (never a leased one) is in the keyed-settled zset exactly while
  -- keyed_settled holds, due from the updated_at at which it entered: NX keeps the score of
  -- one already there, a write that leaves the set takes it out.
  if keyed then
    if keyed_settled(e) then
      redis.call('ZADD', index.keyed_settled, 'NX', tonumber(e.updated_at), id)
    else
      redis.call('ZREM', index.keyed_settled, id)
    end
  end
end

-- Store a record and keep its indexes and the change feed (an event when the state moved from
-- prior's, which every caller of this passes); returns the stored text (the scripts answer
-- with it).
local function save_effect(index, key, e, prior)
  local raw = cjson.encode(e)
  redis.call('HSET', key, e.effect_id, raw)
  index_effect(index, e, prior)
  if prior.state ~= e.state then effect_event(index, e) end
  return raw
end

-- Append a new forward (attempt) and make the record PREPARED again.
local function add_attempt(e, now, attempt_id, generation, deadline_ms, forward_id)
  local i = tonumber(e.attempt_count or '0')
  local p = 'a' .. s(i) .. '_'
  e[p .. 'attempt_id'] = attempt_id
  if forward_id ~= nil and forward_id ~= '' then e[p .. 'forward_id'] = forward_id end
  e[p .. 'claim_generation'] = generation
  e[p .. 'started_at'] = s(now)
  e.attempt_count = s(i + 1)
  e.state = 'PREPARED'
  e.deadline_at = s(now + tonumber(deadline_ms))
  e.updated_at = s(now)
end
