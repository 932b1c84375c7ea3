-- Step two of a proxied mutation (mirror of ledger.effects.complete): record forward `seq`'s
-- outcome, only while the record still waits for that forward.
-- KEYS[1] the task's effects hash (a keyed effect's own hash), KEYS[2] prepared index,
-- KEYS[3] unknown index, KEYS[4] awaiting-approval index, KEYS[5] probe-due index,
-- KEYS[6] event stream, KEYS[7] keyed-settled index, KEYS[8] keyed-prepared index,
-- KEYS[9] keyed-unknown index (KEYS[7..9] only for a keyed effect)
-- ARGV[1] test clock (see now_ms), ARGV[2] effectId, ARGV[3] seq, ARGV[4] attemptId,
-- ARGV[5] outcome, ARGV[6] reason, ARGV[7] response JSON or '' to keep the stored one,
-- and, when the gateway holds the record its prepare answered (RedisStore._held), the step it
-- decided on that record (ledger.effects.complete, which this script mirrors): ARGV[8] the
-- record as prepare stored it, ARGV[9] the completed record's text up to its two times (it
-- ends in '"a<seq>_ended_at":"'), ARGV[10] its state, ARGV[11] its attempt_count,
-- ARGV[12] its approval_digest, ARGV[13] next_probe_at, ARGV[14] idempotency_key (each ''
-- for none), ARGV[15] its event's text up to its time. ARGV[8] = '' for none.
-- Returns {'OK'|'STALE', record (cjson text, as stored)}, {'DONE', now} when the gateway's
-- step was written (the record still was the one it decided on), or
-- {'ERR', 'NO_SUCH_EFFECT', ''}
local effects_key = KEYS[1]
local index = effect_indexes(KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8],
                             KEYS[9])
local now = now_ms(ARGV[1])
local effect_id = ARGV[2]
local seq = tonumber(ARGV[3])
local attempt_id = ARGV[4]
local outcome = ARGV[5]
local reason = ARGV[6]
local response = ARGV[7]

local raw = redis.call('HGET', effects_key, effect_id)
if not raw then return err('NO_SUCH_EFFECT') end
if raw == ARGV[8] then
  -- The record is exactly the one the gateway decided on: write its result, without decoding
  -- and re-encoding the record here (most of this step's time). Only the PREPARED record
  -- prepare answered is held, so the record was in the prepared index and awaited nothing.
  local n = s(now)
  redis.call('HSET', effects_key, effect_id, ARGV[9] .. n .. '","updated_at":"' .. n .. '"}')
  local function given(v) if v == '' then return nil end return v end
  index_effect(index, {effect_id = effect_id, state = ARGV[10], attempt_count = ARGV[11],
    approval_digest = given(ARGV[12]), next_probe_at = given(ARGV[13]),
    idempotency_key = given(ARGV[14]), updated_at = n}, HELD_RECORD)
  redis.call('XADD', index.events, '*', 'e', ARGV[15] .. n .. '}')
  return {'DONE', n}
end
local e = cjson.decode(raw)
if seq ~= tonumber(e.attempt_count) - 1 then return {'STALE', raw} end
local p = 'a' .. s(seq) .. '_'
local waiting = e.state == 'PREPARED'
  or (e.state == 'UNKNOWN' and e[p .. 'reason'] == DEADLINE_REASON)
if e[p .. 'attempt_id'] ~= attempt_id or not waiting then return {'STALE', raw} end
local prior = index_state(e)
e[p .. 'ended_at'] = s(now)
e[p .. 'outcome'] = outcome
e[p .. 'reason'] = reason
e.state = state_after(e, seq, outcome)
approval_after(e, e.state, reason)
e.deadline_at = nil
if response ~= '' then e.response = response end
e.updated_at = s(now)
return {'OK', save_effect(index, effects_key, e, prior)}
