-- Step two of a proxied mutation (mirror of ledger.effects.complete): record forward `seq`'s
-- outcome, only while the record still waits for that forward.
-- KEYS[1] the task's effects hash (a keyed effect's own hash), KEYS[2] prepared index,
-- KEYS[3] unknown index, KEYS[4] awaiting-approval index, KEYS[5] probe-due index,
-- KEYS[6] event stream, KEYS[7] keyed-settled index, KEYS[8] keyed-prepared index,
-- KEYS[9] keyed-unknown index (KEYS[7..9] only for a keyed effect)
-- ARGV[1] test clock (see now_ms), ARGV[2] effectId, ARGV[3] seq, ARGV[4] attemptId,
-- ARGV[5] outcome, ARGV[6] reason, ARGV[7] response JSON or '' to keep the stored one
-- Returns {'OK'|'STALE', record (cjson text, as stored)} or {'ERR', 'NO_SUCH_EFFECT', ''}
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
