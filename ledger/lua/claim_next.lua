-- Claim the best claimable task of a queue (mirror of ledger.tasks.claim_next), from the
-- queue's indexes (task_lib.lua), never a scan of the queue:
--   1. refusals first, as a claim by id: what the bucket admits (claim_admission: claims
--      paused, a freeze, a bump's barrier), a stale schedulerEpoch;
--   2. move at most MOVES claims that became claimable from `held` (lease run out) and from
--      `epochs` (granted under an older epoch) into `ready`;
--   3. take the head of `ready` and check it against the task (it exists, is in this queue,
--      the member is its queue_member, is_claimable): a stale entry is dropped (the task is
--      put back where its state says) and the next head tried, at most TRIES times;
--   4. claim it exactly as claim.lua does.
-- KEYS[1] scheduler hash, KEYS[2] leases index, KEYS[3] the queue's ready index,
-- KEYS[4] its held index, KEYS[5] its epochs index
-- ARGV[1] test clock (see now_ms), ARGV[2] key prefix (see task_lib.lua), ARGV[3] queue,
-- ARGV[4] owner, ARGV[5] ttlMs, ARGV[6] schedulerEpoch, ARGV[7] new attemptId,
-- ARGV[8] max ttl ms, ARGV[9] default max runtime ms, ARGV[10] the claiming principal ('' for
-- none)
-- Returns {'OK', fields...}, {'NONE'} when no task is claimable, or {'ERR', code, detail}
local MOVES, TRIES = 64, 16
local leases, ready, held, epochs = KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local queue = ARGV[3]
local now = now_ms(ARGV[1])
local epoch, barred = claim_admission(KEYS[1], now)
if not epoch then return barred end
if tonumber(ARGV[6]) ~= epoch then
  return err('STALE_EPOCH', 'schedulerEpoch ' .. ARGV[6] .. ' is not the current ' .. s(epoch))
end

local FIELDS = {'task_id', 'state', 'queue', 'priority', 'ready_at', 'created_at',
  'lease_expires_at', 'claim_epoch'}

-- Claims that became claimable: out of held/epochs, into ready (where the task's fields say).
local function move(ids)
  for _, id in ipairs(ids) do
    redis.call('ZREM', held, id)
    redis.call('ZREM', epochs, id)
    local v = load_fields(task_key(id), FIELDS)
    if v and v.queue == queue then
      if is_claimable(v, epoch, now) then
        redis.call('ZADD', ready, 0, queue_member(v))
      else
        queue_add(v) -- a stale entry: put it back where its state says
      end
    end
  end
end
move(redis.call('ZRANGEBYSCORE', held, '-inf', now, 'LIMIT', 0, MOVES))
move(redis.call('ZRANGEBYSCORE', epochs, '-inf', '(' .. s(epoch), 'LIMIT', 0, MOVES))

for _ = 1, TRIES do
  local head = redis.call('ZRANGE', ready, 0, 0)[1]
  if not head then break end
  local id = string.sub(head, 25) -- after '%07d:%015d:'
  local key = task_key(id)
  local t = load_hash(key)
  if t and t.queue == queue and queue_member(t) == head and is_claimable(t, epoch, now) then
    local before = before_of(t)
    local refused = claim_task(t, now, epoch, ARGV[4], tonumber(ARGV[5]), ARGV[7],
      tonumber(ARGV[8]), tonumber(ARGV[9]), ARGV[10])
    if refused then return refused end -- cannot happen: the task is claimable
    save_hash(key, t)
    task_changed(leases, before, t)
    return task_answer('OK', t)
  end
  redis.call('ZREM', ready, head)
  if t and t.queue == queue then
    -- Where the task belongs now (a CLAIMED one that is claimable goes back to ready).
    if is_claimable(t, epoch, now) then
      redis.call('ZADD', ready, 0, queue_member(t))
    else
      queue_add(t)
    end
  end
  loaded[key] = nil
end
return {'NONE'}
