-- The decision of a prepare once its record is in hand (mirror of ledger.effects.prepare
-- after the fence check), shared by prepare.lua (a leased effect: it checks the claim first)
-- and prepare_keyed.lua (a keyed effect: no task, no claim). Prepended after effect_lib.lua.
-- r, the request: now, key (the hash holding the record), index (effect_indexes),
-- attempt_id and generation (the new attempt's: the claim's, or a keyed call's forward id
-- and 0), downstream, method, path, digest (payloadDigest), deadline_ms, resend_window ('' for
-- none), require_approval (boolean), forward_id ('' for none), requester (the principal
-- recorded as requested_by, nil for none), approval (the request's approval digest, '' when
-- it is the payload digest), request (the request as forwarded, '' when none is kept).
-- e: the record (as decoded, or new), raw: its stored text (nil for a new one), prior: its
-- index_state (NEW_RECORD for a new one), changed: whether the step already changed it.
-- Returns the script's answer: {'FORWARD'|'REPLAY', record} or
-- {'REJECT', code, detail, retryAfterMs or '', record}, record as stored (cjson text).
local function decide(r, e, raw, prior, changed)
  local now, digest, requester = r.now, r.digest, r.requester
  -- What an approval must name (ledger.effects.prepare: wanted, requested_digest).
  local wanted = digest
  local requested = nil
  if r.approval ~= nil and r.approval ~= '' and r.approval ~= digest then
    wanted = r.approval
    requested = r.approval
  end
  local same = e.payload_digest == digest
  local in_window = r.resend_window ~= ''
    and now < tonumber(e.created_at) + tonumber(r.resend_window)
  if e.state == 'NOT_APPLIED' or (e.state == 'UNKNOWN' and same and in_window) then
    local moved = changed or not same or requester ~= e.requested_by
      or requested ~= e.requested_digest
    if moved then e.updated_at = s(now) end
    e.downstream = r.downstream
    e.method = r.method
    e.path = r.path
    e.payload_digest = digest
    e.requested_by = requester
    e.requested_digest = requested
    local approver = nil
    if r.require_approval then
      local approved = e.approval_digest == wanted and e.approval_expires_at ~= nil
        and now < tonumber(e.approval_expires_at)
        and not (requester ~= nil and e.approval_by == requester)
      if not approved then
        local stored = raw
        if moved then
          -- What the approver decides on (ledger.effects.prepare: the rebound request_json).
          if r.request ~= nil and r.request ~= '' then e.request = r.request else e.request = nil end
          stored = save_effect(r.index, r.key, e, prior)
        end
        if not stored then stored = cjson.encode(e) end
        -- ledger.effects._naming
        local naming = 'payloadDigest ' .. digest
        if requested then
          naming = 'approvalDigest ' .. wanted .. ' (payloadDigest ' .. digest
            .. ' and its effect-changing headers)'
        end
        return {'REJECT', 'APPROVAL_REQUIRED', 'an operator must approve ' .. naming
          .. ': POST /v1/effects/' .. e.effect_id .. '/approve', '', stored}
      end
      approver = e.approval_by
    else
      approval_after(e, 'PREPARED', nil)
    end
    -- An approval stays on the record while its forward runs (complete.lua: approval_after).
    e.probe_holder = nil
    e.probe_until = nil
    -- The forward's own request, or none (ledger.effects.prepare: request_json).
    if r.request ~= nil and r.request ~= '' then e.request = r.request else e.request = nil end
    local i = tonumber(e.attempt_count)
    add_attempt(e, now, r.attempt_id, r.generation, r.deadline_ms, r.forward_id)
    if approver then e['a' .. s(i) .. '_approved_by'] = approver end
    return {'FORWARD', save_effect(r.index, r.key, e, prior)}
  end

  local code, detail, retry = nil, nil, ''
  if not same then
    code = 'PAYLOAD_CONFLICT'
    detail = 'effect ' .. e.effect_id .. ' is bound to payloadDigest ' .. e.payload_digest
  elseif e.state == 'COMMITTED' then
    if changed then raw = save_effect(r.index, r.key, e, prior) end
    return {'REPLAY', raw}
  elseif e.state == 'PREPARED' then
    code = 'EFFECT_IN_FLIGHT'
    detail = 'the same effect is being forwarded right now'
    retry = s(math.max(tonumber(e.deadline_at) - now, 0))
  else
    code = 'EFFECT_UNKNOWN'
    detail = 'an earlier forward of this effect has an unknown outcome'
  end
  if changed then raw = save_effect(r.index, r.key, e, prior) end
  return {'REJECT', code, detail, retry, raw}
end
