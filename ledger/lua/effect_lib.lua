-- Helpers for the effect scripts (prepended after common.lua). An effect record is a flat
-- map of strings, stored cjson-encoded as one field of the task's effects hash; attempt i
-- lives in fields a<i>_attempt_id, a<i>_claim_generation, a<i>_started_at, a<i>_ended_at,
-- a<i>_outcome, a<i>_reason (ledger.effects.effect_to_fields).

local DEADLINE_REASON = 'deadline passed'

-- Mirror of ledger.effects.is_overdue: a PREPARED past its deadline.
local function is_overdue(e, now)
  return e.state == 'PREPARED' and e.deadline_at ~= nil and now >= tonumber(e.deadline_at)
end

-- Mirror of ledger.effects.is_awaiting_approval: NOT_APPLIED with no attempts.
local function is_awaiting_approval(e)
  return e.state == 'NOT_APPLIED' and e.attempt_count == '0'
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
-- them: prepared zset, unknown set, awaiting set, probe-due zset). Each effect script builds
-- this once from its own KEYS and hands it to index_effect / save_effect.
local function effect_indexes(prepared, unknown, awaiting, probe_due)
  return {prepared = prepared, unknown = unknown, awaiting = awaiting, probe_due = probe_due}
end

-- Keep the indexes in step with one record. The prepared zset is scored by the deadline, so
-- "score <= now" is ledger.effects.is_overdue (lua/gauges.lua, RedisStore.unsettled_effects);
-- the probe-due zset is scored by next_probe_at, 0 for never probed
-- (ledger.queries.is_probe_due); the awaiting set is ledger.effects.is_awaiting_approval.
local function index_effect(index, e)
  local id = e.effect_id
  if e.state == 'PREPARED' then
    redis.call('ZADD', index.prepared, tonumber(e.deadline_at), id)
  else
    redis.call('ZREM', index.prepared, id)
  end
  if e.state == 'UNKNOWN' then
    redis.call('SADD', index.unknown, id)
    if e.next_probe_at then
      redis.call('ZADD', index.probe_due, tonumber(e.next_probe_at), id)
    else
      -- NX: a reconciler may have parked it (a downstream without a probe).
      redis.call('ZADD', index.probe_due, 'NX', 0, id)
    end
  else
    redis.call('SREM', index.unknown, id)
    redis.call('ZREM', index.probe_due, id)
  end
  if is_awaiting_approval(e) then
    redis.call('SADD', index.awaiting, id)
  else
    redis.call('SREM', index.awaiting, id)
  end
end

local function save_effect(index, key, e)
  redis.call('HSET', key, e.effect_id, cjson.encode(e))
  index_effect(index, e)
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
