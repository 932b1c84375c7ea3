-- One step of the scheduler record, answering the whole record after it.
-- On one Redis the record is the one every acceptance point reads (epoch, paused) and the
-- steps are the first four below. On a Redis Cluster each bucket keeps a copy
-- (ledger.scheduler_copies.Copy: also barrier_target and barrier_until_ms, both or neither,
-- and pause_generation; bucket 0's also holds the bump's intent, intent_target and
-- intent_deadline_ms, both or neither), which the cluster store moves with the copy steps,
-- each the mirror of the function of ledger.scheduler_copies it is named after, and freezes
-- while the bucket's slot moves to another node (`frozen`: task_lib.lua, frozen_refusal).
-- KEYS[1] scheduler hash
-- ARGV[1] the step, then its arguments (integers, as text, unless said otherwise):
--   the one record: 'read' (writes nothing), 'bump' (epoch + 1), 'pause', 'resume';
--   the copy steps: 'begin_pause' paused(0|1); 'with_paused' paused(0|1) generation;
--   'begin_bump' target deadline_ms; 'with_barrier' target until_ms; 'bumped' target;
--   'without_barrier' target; 'end_bump' target;
--   the freeze: 'freeze' why (text, not empty: what moves the bucket, for an operator);
--   'thaw'.
-- Returns {epoch, paused(0|1), barrier_target, barrier_until_ms, pause_generation,
--          intent_target, intent_deadline_ms, frozen} ('' for an absent field), or
--          {'ERR', 'BAD_REQUEST', detail} for a step it does not know (nothing written).
local key, op = KEYS[1], ARGV[1]
local v = redis.call('HMGET', key, 'epoch', 'paused', 'barrier_target', 'barrier_until_ms',
  'pause_generation', 'intent_target', 'intent_deadline_ms', 'frozen')
local c = {epoch = tonumber(v[1] or '1'), paused = v[2] == '1', barrier_target = num(v[3]),
           barrier_until_ms = num(v[4]), pause_generation = num(v[5]) or 0,
           intent_target = num(v[6]), intent_deadline_ms = num(v[7])}
local frozen = v[8] or nil
local a, b = tonumber(ARGV[2]), tonumber(ARGV[3])

-- The one-record steps write epoch and paused, as they always have; a copy step writes the
-- whole copy (an absent field deleted); the freeze only its own field.
local function save_record()
  redis.call('HSET', key, 'epoch', s(c.epoch), 'paused', c.paused and '1' or '0')
end
local function save_copy()
  local set, gone = {'epoch', s(c.epoch), 'paused', c.paused and '1' or '0',
    'pause_generation', s(c.pause_generation)}, {}
  for _, name in ipairs({'barrier_target', 'barrier_until_ms', 'intent_target',
                         'intent_deadline_ms'}) do
    if c[name] == nil then
      gone[#gone + 1] = name
    else
      set[#set + 1] = name
      set[#set + 1] = s(c[name])
    end
  end
  redis.call('HSET', key, unpack(set))
  if #gone > 0 then redis.call('HDEL', key, unpack(gone)) end
end

if op == 'read' then
  -- nothing to write
elseif op == 'bump' then
  c.epoch = c.epoch + 1
  save_record()
elseif op == 'pause' or op == 'resume' then
  c.paused = op == 'pause'
  save_record()
elseif op == 'begin_pause' then
  -- begin_pause: bucket 0's copy with the next pause_generation, the step's number.
  c.paused = a == 1
  c.pause_generation = c.pause_generation + 1
  save_copy()
elseif op == 'with_paused' then
  -- with_paused: a later-numbered pause or resume already here wins.
  if b >= c.pause_generation then
    c.paused = a == 1
    c.pause_generation = b
  end
  save_copy()
elseif op == 'begin_bump' then
  -- begin_bump: set-if-absent, never toward an epoch bucket 0 has reached.
  if c.intent_target == nil then
    c.intent_target = math.max(a, c.epoch + 1)
    c.intent_deadline_ms = b
  end
  save_copy()
elseif op == 'with_barrier' then
  -- with_barrier: not for a bump that is over here (the copy is past its target) nor under
  -- a later bump's barrier; again for the same target it keeps the later deadline.
  if c.epoch <= a and not (c.barrier_target ~= nil and c.barrier_target > a) then
    local until_ms = b
    if c.barrier_target == a and c.barrier_until_ms ~= nil then
      until_ms = math.max(until_ms, c.barrier_until_ms)
    end
    c.barrier_target, c.barrier_until_ms = a, until_ms
  end
  save_copy()
elseif op == 'bumped' then
  -- bumped: the epoch never goes down.
  c.epoch = math.max(c.epoch, a)
  save_copy()
elseif op == 'without_barrier' then
  -- without_barrier: only the barrier of the bump toward `a`.
  if c.barrier_target == a then c.barrier_target, c.barrier_until_ms = nil, nil end
  save_copy()
elseif op == 'end_bump' then
  -- end_bump: only the intent toward `a`.
  if c.intent_target == a then c.intent_target, c.intent_deadline_ms = nil, nil end
  save_copy()
elseif op == 'freeze' and ARGV[2] ~= nil and ARGV[2] ~= '' then
  frozen = ARGV[2]
  redis.call('HSET', key, 'frozen', frozen)
elseif op == 'thaw' then
  frozen = nil
  redis.call('HDEL', key, 'frozen')
else
  return err('BAD_REQUEST', 'no scheduler step ' .. tostring(op))
end

local function opt(x)
  if x == nil then return '' end
  return s(x)
end
return {s(c.epoch), c.paused and '1' or '0', opt(c.barrier_target), opt(c.barrier_until_ms),
        s(c.pause_generation), opt(c.intent_target), opt(c.intent_deadline_ms), frozen or ''}
