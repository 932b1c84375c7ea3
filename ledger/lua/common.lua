-- Helpers prepended to every fencegate script (ledger/redis_store.py joins the files).
-- Time is in milliseconds in every script. Each script reads TIME exactly once, through now_ms.
-- A task is a hash of strings; an absent field is nil (None in ledger/tasks.py).
-- Scripts answer {'OK'|other status, field, value, ...} with the task's fields after the step,
-- or {'ERR', code, detail} having written nothing.

-- Store time from a script's ARGV[1], the test clock (ledger/redis_store.py, _clock_arg): an
-- offset in ms added to TIME ('0' in production), or '=<ms>', the exact instant, which only
-- tests send (RedisStore.clock_pinned_ms) so their histories replay identically.
local function now_ms(clock)
  if string.sub(clock, 1, 1) == '=' then return tonumber(string.sub(clock, 2)) end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(clock)
end

local function s(n)
  return string.format('%d', n)
end

local function num(x)
  if x == nil or x == false then return nil end
  return tonumber(x)
end

-- Extra problem members follow as name, value pairs (integers, as strings): the gateway
-- composes what people read from them (ISO times), so this text stays the Python model's.
local function err(code, detail, ...)
  local out = {'ERR', code, detail or ''}
  for _, v in ipairs({...}) do out[#out + 1] = v end
  return out
end

-- What load_hash read, per key, so save_hash writes only the fields a step changed.
local loaded = {}

local function load_hash(key)
  local flat = redis.call('HGETALL', key)
  if #flat == 0 then return nil end
  local h, was = {}, {}
  for i = 1, #flat, 2 do
    h[flat[i]] = flat[i + 1]
    was[flat[i]] = flat[i + 1]
  end
  loaded[key] = was
  return h
end

-- Only the named fields of a hash (HMGET), for steps that read a task without changing it:
-- nil when the hash has no task_id (no such task). Such a table must not go to save_hash.
local function load_fields(key, names)
  local values = redis.call('HMGET', key, unpack(names))
  local h = {}
  for i, name in ipairs(names) do
    if values[i] then h[name] = values[i] end
  end
  if not h.task_id then return nil end
  return h
end

-- Write a hash as `h` holds it: the fields that changed since load_hash read it (HSET), and
-- those set to nil (HDEL); a hash that was not loaded is written whole. The outcome is the
-- same as rewriting the whole hash (fields set to nil disappear), for far fewer field writes.
local function save_hash(key, h)
  local was = loaded[key]
  local flat = {}
  for k, v in pairs(h) do
    if not was or was[k] ~= v then
      flat[#flat + 1] = k
      flat[#flat + 1] = v
    end
  end
  if was then
    local gone = {}
    for k in pairs(was) do
      if h[k] == nil then gone[#gone + 1] = k end
    end
    if #gone > 0 then redis.call('HDEL', key, unpack(gone)) end
  else
    redis.call('DEL', key)
  end
  if #flat > 0 then redis.call('HSET', key, unpack(flat)) end
  loaded[key] = nil
end

local function answer(status, h)
  local out = {status}
  for k, v in pairs(h) do
    out[#out + 1] = k
    out[#out + 1] = v
  end
  return out
end

-- Keep the leases index (a sorted set of CLAIMED tasks by expiry) in step with a task; a
-- lease is active while its score is above now (mirror of ledger.queries.is_lease_active).
local function index_lease(key, t)
  if t.state == 'CLAIMED' then
    redis.call('ZADD', key, tonumber(t.lease_expires_at), t.task_id)
  else
    redis.call('ZREM', key, t.task_id)
  end
end

-- The scheduler record: epoch (default 1) and the claims-paused flag (on a Redis Cluster, the
-- bucket's copy of it; task_lib.lua reads the rest of a copy, scheduler.lua writes it).
local function scheduler(key)
  local e = redis.call('HMGET', key, 'epoch', 'paused')
  return tonumber(e[1] or '1'), e[2] == '1'
end

-- Mirror of ledger.tasks.check_principal: the caller's principal ('' or nil for none) must be
-- the claim's when both are known. Returns an error reply or nil.
local function check_principal(t, principal)
  if principal ~= nil and principal ~= '' and t.principal ~= nil and t.principal ~= ''
      and t.principal ~= principal then
    return err('FENCED', 'the lease belongs to another principal')
  end
  return nil
end

-- Mirror of ledger.tasks.check_holder: identity (attempt, generation, owner, then the
-- principal), epoch (skipped when check_epoch is false), cancel generation, revision.
-- principal: the caller's authenticated principal, '' for none. Returns an error reply or nil.
local function check_holder(t, attempt_id, generation, owner, cancel_gen, check_epoch, epoch, req_epoch,
                            principal)
  if not t then return err('NO_SUCH_TASK') end
  if t.attempt_id ~= attempt_id or tonumber(t.claim_generation) ~= generation
      or (owner ~= nil and t.owner ~= owner) then
    return err('FENCED', 'attempt ' .. attempt_id .. ' generation ' .. s(generation)
      .. ' is not the current claim (generation ' .. t.claim_generation .. ')')
  end
  local other = check_principal(t, principal)
  if other then return other end
  if check_epoch and (req_epoch ~= epoch or num(t.claim_epoch) ~= epoch) then
    return err('STALE_EPOCH', 'schedulerEpoch ' .. s(req_epoch) .. ' sent, claim made under '
      .. tostring(t.claim_epoch) .. ', current is ' .. s(epoch))
  end
  if t.state == 'CANCELLED' or cancel_gen ~= tonumber(t.cancel_generation) then
    local cancelled = ''
    if t.state == 'CANCELLED' then cancelled = ' and is cancelled' end
    return err('CANCELLED', 'cancelGeneration ' .. s(cancel_gen) .. ', task has '
      .. t.cancel_generation .. cancelled)
  end
  if num(t.claim_revision) ~= tonumber(t.revision) then
    return err('STALE_INPUT', 'claim was for revision ' .. tostring(t.claim_revision)
      .. ', the task is at ' .. t.revision)
  end
  if t.state == 'WAITING' or t.state == 'READY' then
    -- Only a dependency's new revision leaves a claim's identity on a WAITING (and later
    -- READY) task: what the attempt built on is gone.
    return err('STALE_INPUT',
      'a dependency of this task has a new revision; claim it again when it is READY')
  end
  return nil
end

-- A bucket whose slot is moving to another node (a Redis Cluster slot migration) is frozen:
-- the cluster store sets its scheduler copy's `frozen` field (scheduler.lua's 'freeze')
-- before the first key moves and clears it once the slot is the new node's. A script that
-- touches a key it did not declare in KEYS (another task, a queue index, the feed, ...)
-- fails at that key once it has moved, after the writes it already made, and on the
-- importing node reads a key not moved yet as missing; a declared key is safe (Redis
-- answers TRYAGAIN or ASK before the script runs). So every task script declares its
-- bucket's scheduler hash and refuses FROZEN while the field is set, before any write and
-- before any key it did not declare. On one Redis the field is never set.
local function frozen_refusal()
  return err('FROZEN', 'the bucket is moving to another node')
end

-- The freeze check of the scripts that read nothing else of the scheduler: one HGET.
-- Returns an error reply or nil.
local function check_not_frozen(scheduler_key)
  local frozen = redis.call('HGET', scheduler_key, 'frozen')
  if frozen and frozen ~= '' then return frozen_refusal() end
  return nil
end
