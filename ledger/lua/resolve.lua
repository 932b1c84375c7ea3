-- An operator settles an UNKNOWN effect (mirror of ledger.effects.resolve).
-- KEYS[1] the task's effects hash
-- ARGV[1] clock offset ms, ARGV[2] effectId, ARGV[3] outcome (COMMITTED | NOT_APPLIED),
-- ARGV[4] note, ARGV[5] operator, ARGV[6] response JSON or ''
-- Returns {'OK', effect fields...} or {'ERR', code, detail, effect state}
local now = now_ms(ARGV[1])
local raw = redis.call('HGET', KEYS[1], ARGV[2])
if not raw then return err('NO_SUCH_EFFECT') end
local e = cjson.decode(raw)
expire_effect(e, now)
if e.state == 'PREPARED' then
  return {'ERR', 'EFFECT_IN_FLIGHT', 'the effect is being forwarded right now; wait for its outcome',
          e.state}
end
if e.state ~= 'UNKNOWN' then
  if e.state == ARGV[3] and e.resolved_by then return answer('OK', e) end
  return {'ERR', 'EFFECT_SETTLED', 'the effect is already ' .. e.state, e.state}
end
e.state = ARGV[3]
if ARGV[3] == 'COMMITTED' and ARGV[6] ~= '' then e.response = ARGV[6] else e.response = nil end
e.resolved_by = ARGV[5]
e.resolved_at = s(now)
e.resolution_note = ARGV[4]
e.updated_at = s(now)
save_effect(KEYS[1], e)
return answer('OK', e)
