-- Step one of a proxied mutation under a lease (mirror of ledger.effects.prepare): validate
-- the claim, then read the effect record and decide (prepare_lib.lua), in one atomic step.
-- A keyed effect's prepare is prepare_keyed.lua.
-- KEYS[1] task hash, KEYS[2] scheduler hash, KEYS[3] the task's effects hash,
-- KEYS[4] effects index (zset, by creation), KEYS[5] effectId -> taskId hash,
-- KEYS[6] prepared index, KEYS[7] unknown index, KEYS[8] awaiting-approval index,
-- KEYS[9] probe-due index, KEYS[10] event stream, KEYS[11] effect ids index (zset, by id),
-- KEYS[12] the list of creation-index entries not yet added (format 3, index_catch_up.lua)
-- ARGV[1] test clock (see now_ms), ARGV[2] attemptId, ARGV[3] claimGeneration,
-- ARGV[4] schedulerEpoch, ARGV[5] cancelGeneration, ARGV[6] node, ARGV[7] slot,
-- ARGV[8] downstream, ARGV[9] method, ARGV[10] path, ARGV[11] payloadDigest,
-- ARGV[12] forward deadline ms,
-- ARGV[13] the adapter's re-send window ms for UNKNOWN effects with the same payload, or '',
-- ARGV[14] '1' when every forward needs an operator's approval of its payload digest,
-- ARGV[15] the request's forward id ('' for none),
-- ARGV[16] the caller's principal ('' for none): checked against the claim's
-- (check_principal), recorded as requested_by, and never the consumer of its own approval,
-- ARGV[17] the task revision the gateway believes this claim is for ('' when it does not
-- know), ARGV[18] the effectId the gateway computed from that revision (ledger.effects.effect_id),
-- ARGV[19] the request's approval digest (ledger.effects.approval_digest; '' when it is the
-- payload digest), ARGV[20] the request as forwarded (ledger.requests; '' when its
-- downstream keeps no request bodies): the record's ``request`` from this forward on,
-- ARGV[21] the new record as the gateway built it (RedisStore._new_forward, mirroring the
-- decision below for a record that does not exist yet, with no approval required), up to its
-- times: used only when the record does not exist and its id is ARGV[18]; '' for none,
-- ARGV[22] that record's event up to its time, ARGV[23] '1' when the store's format (3) lets
-- that record's creation-index entry wait in KEYS[12] for index_catch_up.lua, '' when the
-- indexes are written here (format 2: older gateways read them without catching up)
-- Returns {'FORWARD'|'REPLAY', record}, {'REJECT', code, detail, retryAfterMs or '', record},
-- {'NEW', now} when ARGV[21]'s record was stored (the gateway completes it with now), or
-- {'ERR', code, detail} when the claim itself is refused; record is the effect record as
-- stored (cjson text): one bulk string instead of ~50 field/value pairs to build and parse.
local task_key, scheduler_key, effects_key = KEYS[1], KEYS[2], KEYS[3]
local effects_order, effect_tasks = KEYS[4], KEYS[5]
local effect_ids = KEYS[11]
local index = effect_indexes(KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10])
local now = now_ms(ARGV[1])
local attempt_id = ARGV[2]
local generation = ARGV[3]
local req_epoch = tonumber(ARGV[4])
local cancel_gen = tonumber(ARGV[5])
local node, slot = ARGV[6], ARGV[7]
local downstream, method, path = ARGV[8], ARGV[9], ARGV[10]
local digest = ARGV[11]
local deadline_ms = ARGV[12]
local resend_window = ARGV[13]
local require_approval = ARGV[14] == '1'
local forward_id = ARGV[15]
local principal = ARGV[16]
local requester = nil
if principal ~= '' then requester = principal end

local epoch = scheduler(scheduler_key)
-- Only the fields this step reads: prepare never writes the task.
local t = load_fields(task_key, {'task_id', 'state', 'revision', 'attempt_id',
  'claim_generation', 'principal', 'claim_epoch', 'cancel_generation', 'claim_revision',
  'lease_expires_at'})
local bad = check_holder(t, attempt_id, tonumber(generation), nil, cancel_gen, true, epoch,
  req_epoch, principal)
if bad then return bad end
if t.state == 'COMMITTED' then
  return err('ALREADY_COMMITTED', 'the task is committed; its attempt may produce no more effects')
end
if now >= tonumber(t.lease_expires_at) then
  return err('LEASE_EXPIRED', 'lease expired at leaseExpiresAt ' .. t.lease_expires_at,
    'leaseExpiresAt', t.lease_expires_at)
end

-- The effectId is H(taskId, revision, node, slot). The pure-Lua SHA-256 cost ~75 us of Redis
-- CPU per call, so the gateway computes it (in C) from the revision it believes the claim is
-- for, and this step only checks that revision against the task's, inside the same atomic step
-- that reads it: when they are equal the id is exactly the one computed here, and the check
-- does not depend on how the gateway came by the revision (a stale or wrong guess, e.g. after
-- Redis lost data and reissued a generation, just falls back to computing it here).
local eid
if ARGV[17] ~= '' and ARGV[17] == t.revision then
  eid = ARGV[18]
else
  eid = effect_id(t.task_id, t.revision, node, slot)
end
if ARGV[21] ~= '' and eid == ARGV[18] and not require_approval then
  -- A new effect forwarded at once (the common case): the record the gateway built, with
  -- this step's times, stored only if the effect does not exist (HSETNX: the look-up and the
  -- write in one command), with what the general path below does for a new record (the
  -- prepared index, the event) without building, deciding and encoding it here. At format 3
  -- the three creation indexes are not written here: their entry waits in a list, one cheap
  -- RPUSH, and index_catch_up.lua adds many at once, before any reader looks.
  local n = s(now)
  local deadline = s(now + tonumber(deadline_ms))
  if redis.call('HSETNX', effects_key, eid, ARGV[21] .. n .. '","updated_at":"' .. n
      .. '","a0_started_at":"' .. n .. '","deadline_at":"' .. deadline .. '"}') == 1 then
    local member = string.format('%015d', now) .. ':' .. eid .. ':' .. t.task_id
    redis.call('ZADD', index.prepared, deadline, eid)
    if ARGV[23] == '1' then
      redis.call('RPUSH', KEYS[12], member)
    else
      redis.call('ZADD', effects_order, 0, member)
      redis.call('HSET', effect_tasks, eid, t.task_id)
      redis.call('ZADD', effect_ids, 0, eid)
    end
    redis.call('XADD', index.events, '*', 'e', ARGV[22] .. n .. '}')
    return {'NEW', n}
  end
end
local raw = redis.call('HGET', effects_key, eid)
local e
local changed
local prior = NEW_RECORD
if not raw then
  e = {effect_id = eid, task_id = t.task_id, revision = t.revision, node = node,
       slot = slot, downstream = downstream, method = method, path = path,
       payload_digest = digest, state = 'NOT_APPLIED', attempt_count = '0',
       probe_count = '0', created_at = s(now), updated_at = s(now)}
  local member = string.format('%015d', now) .. ':' .. eid .. ':' .. t.task_id
  redis.call('ZADD', effects_order, 0, member)
  redis.call('HSET', effect_tasks, eid, t.task_id)
  redis.call('ZADD', effect_ids, 0, eid)
  changed = true
else
  e = cjson.decode(raw)
  prior = index_state(e)
  changed = expire_effect(e, now)
end

-- The decision (prepare_lib.lua), as for a keyed effect.
return decide({now = now, key = effects_key, index = index, attempt_id = attempt_id,
  generation = generation, downstream = downstream, method = method, path = path,
  digest = digest, deadline_ms = deadline_ms, resend_window = resend_window,
  require_approval = require_approval, forward_id = forward_id, requester = requester,
  approval = ARGV[19], request = ARGV[20]}, e, raw, prior, changed)
