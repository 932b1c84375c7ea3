-- Step two of a proxied mutation (mirror of ledger.effects.complete): record forward `seq`'s
-- outcome, only while the record still waits for that forward.
-- KEYS[1] the task's effects hash, KEYS[2] prepared index, KEYS[3] unknown index,
-- KEYS[4] awaiting-approval index, KEYS[5] probe-due index
-- ARGV[1] clock offset ms, ARGV[2] effectId, ARGV[3] seq, ARGV[4] attemptId, ARGV[5] outcome,
-- ARGV[6] reason, ARGV[7] response JSON or '' to keep the stored one
-- Returns {'OK'|'STALE', effect fields...} or {'ERR', 'NO_SUCH_EFFECT', ''}
local now = now_ms(ARGV[1])
EFFECT_INDEX = {prepared = KEYS[2], unknown = KEYS[3], awaiting = KEYS[4],
  probe_due = KEYS[5]}
local raw = redis.call('HGET', KEYS[1], ARGV[2])
if not raw then return err('NO_SUCH_EFFECT') end
local e = cjson.decode(raw)
local seq = tonumber(ARGV[3])
if seq ~= tonumber(e.attempt_count) - 1 then return answer('STALE', e) end
local p = 'a' .. s(seq) .. '_'
local waiting = e.state == 'PREPARED'
  or (e.state == 'UNKNOWN' and e[p .. 'reason'] == DEADLINE_REASON)
if e[p .. 'attempt_id'] ~= ARGV[4] or not waiting then return answer('STALE', e) end
e[p .. 'ended_at'] = s(now)
e[p .. 'outcome'] = ARGV[5]
e[p .. 'reason'] = ARGV[6]
e.state = state_after(e, seq, ARGV[5])
e.deadline_at = nil
if ARGV[7] ~= '' then e.response = ARGV[7] end
e.updated_at = s(now)
save_effect(KEYS[1], e)
return answer('OK', e)
