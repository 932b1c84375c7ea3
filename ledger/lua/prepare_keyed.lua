-- Step one of a keyed effect's forward (a lease-less client's call under its idempotency key;
-- mirror of ledger.effects.prepare with request.fence None): no task, no scheduler, no claim
-- to check; read the record and decide (prepare_lib.lua), in one atomic step. The leased
-- path (prepare.lua) does none of this script's work.
-- KEYS[1] the effect's own hash (ledger.keys.Keys.keyed_effect), KEYS[2] effects index
-- (zset, by creation), KEYS[3] effect ids index (zset, by id), KEYS[4] prepared index,
-- KEYS[5] unknown index, KEYS[6] awaiting-approval index, KEYS[7] probe-due index,
-- KEYS[8] event stream, KEYS[9] keyed-settled index, KEYS[10] keyed-prepared index,
-- KEYS[11] keyed-unknown index, KEYS[12] the effect's tombstone hash
-- ARGV[1] test clock (see now_ms), ARGV[2] effectId (ledger.effects.keyed_effect_id, computed
-- by the gateway), ARGV[3] the key's principal (requested_by; never the consumer of its own
-- approval), ARGV[4] the idempotency key, ARGV[5] downstream, ARGV[6] method, ARGV[7] path,
-- ARGV[8] payloadDigest, ARGV[9] forward deadline ms, ARGV[10] the adapter's re-send window
-- ms or '', ARGV[11] '1' when every forward needs an operator's approval, ARGV[12] the
-- forward id (the attempt's id: a keyed forward has no claim, generation 0),
-- ARGV[13] the request's approval digest ('' when it is the payload digest),
-- ARGV[14] the request as forwarded ('' when its downstream keeps no request bodies)
-- Returns what prepare.lua returns, or {'EXPIRED', field, value, ...} (the tombstone's
-- fields) while the id's effect tombstone is not forgotten (ledger.retention.expired_effect):
-- after its forget_at the key is new.
local effect_key, effects_order, effect_ids = KEYS[1], KEYS[2], KEYS[3]
local index = effect_indexes(KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10],
                             KEYS[11])
local stone_key = KEYS[12]
local now = now_ms(ARGV[1])
local eid, principal, idempotency_key = ARGV[2], ARGV[3], ARGV[4]
local downstream, method, path, digest = ARGV[5], ARGV[6], ARGV[7], ARGV[8]

local raw = redis.call('HGET', effect_key, eid)
local e
local changed
local prior = NEW_RECORD
if not raw then
  -- A tombstone past its forget_at counts as absent, whether or not Redis expired it yet.
  local stone = redis.call('HGETALL', stone_key)
  if #stone > 0 then
    local fields = {}
    for i = 1, #stone, 2 do fields[stone[i]] = stone[i + 1] end
    if tonumber(fields.forget_at) > now then
      local out = {'EXPIRED'}
      for _, v in ipairs(stone) do out[#out + 1] = v end
      return out
    end
  end
  e = {effect_id = eid, principal = principal, idempotency_key = idempotency_key,
       downstream = downstream, method = method, path = path, payload_digest = digest,
       state = 'NOT_APPLIED', attempt_count = '0', probe_count = '0', created_at = s(now),
       updated_at = s(now)}
  -- The creation-order member of a keyed effect names no task (an empty task id).
  redis.call('ZADD', effects_order, 0, string.format('%015d', now) .. ':' .. eid .. ':')
  redis.call('ZADD', effect_ids, 0, eid)
  changed = true
else
  e = cjson.decode(raw)
  prior = index_state(e)
  changed = expire_effect(e, now)
end

return decide({now = now, key = effect_key, index = index, attempt_id = ARGV[12],
  generation = '0', downstream = downstream, method = method, path = path, digest = digest,
  deadline_ms = ARGV[9], resend_window = ARGV[10], require_approval = ARGV[11] == '1',
  forward_id = ARGV[12], requester = principal, approval = ARGV[13], request = ARGV[14]},
  e, raw, prior, changed)
