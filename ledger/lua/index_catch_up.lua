-- Bring the creation indexes (effects index, effectId -> taskId directory, effect ids index)
-- up to date (RedisStore.catch_up_indexes). At format 3, prepare.lua's lean path, the common
-- new effect, does not write those three indexes in the fenced step: it pushes the effects
-- index member '<createdAt %015d>:<effectId>:<taskId>' onto a list (one cheap command instead
-- of three index writes), in the same atomic step as the record, so nothing is lost on a
-- crash. This step pops up to `most` of them and adds them to all three indexes with one
-- variadic command each. Every reader of the three indexes runs it first (or on a miss), and
-- each gateway runs it within a bounded lag (docs/decisions.md, "Issue 30: cheaper scripts,
-- and format 3"). Popping and adding in one atomic step means each entry is added exactly
-- once, whoever runs it, and adding what is already there would change nothing anyway.
-- An entry whose record is gone (retention removed it: it catches up first, so only a record
-- removed by hand) is skipped, so no index names an effect that does not exist.
-- KEYS[1] the list of entries not yet added, KEYS[2] effects index, KEYS[3] effectId ->
-- taskId hash, KEYS[4] effect ids index, KEYS[5] the bucket's scheduler hash: refused FROZEN
-- while its slot moves (common.lua) when entries wait, since the records read are keys this
-- script does not declare
-- ARGV[1] test clock (unused), ARGV[2] key prefix (the key layout's P), ARGV[3] most entries
-- Returns {entries popped, effects indexed, 1 if there may be more else 0}, or {'ERR', ...}
local created, order, directory, ids = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local most = tonumber(ARGV[3])

-- Nothing waiting: nothing to read, so nothing to refuse either (a reader of a bucket whose
-- slot moves, with no new effect since its last catch-up, reads on).
if redis.call('LLEN', created) == 0 then return {0, 0, 0} end
local refused = check_not_frozen(KEYS[5])
if refused then return refused end
local entries = redis.call('LPOP', created, most)
local members, fields, names = {}, {}, {}
for _, member in ipairs(entries) do
  local a = string.find(member, ':', 1, true)
  local b = string.find(member, ':', a + 1, true)
  local eid, task = string.sub(member, a + 1, b - 1), string.sub(member, b + 1)
  if redis.call('HEXISTS', K.effects(task), eid) == 1 then
    members[#members + 1] = 0
    members[#members + 1] = member
    fields[#fields + 1] = eid
    fields[#fields + 1] = task
    names[#names + 1] = 0
    names[#names + 1] = eid
  end
end
if #members > 0 then
  redis.call('ZADD', order, unpack(members))
  redis.call('HSET', directory, unpack(fields))
  redis.call('ZADD', ids, unpack(names))
end
local more = 0
if #entries == most then more = 1 end
return {#entries, #members / 2, more}
