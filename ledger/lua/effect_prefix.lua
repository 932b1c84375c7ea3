-- The live effect ids that start with a prefix, in id order (mirror of
-- ledger.queries.effects_with_prefix; the bounds are ledger.queries.effect_prefix_bounds).
-- One atomic read: the ids index may name an effect whose record an older gateway's
-- retention removed (it did not know the index), so an id counts only while the
-- effectId -> taskId hash still names it, or its keyed record (K.keyed_effect, which has no
-- entry there) exists. At most SCAN_MOST index entries are read.
-- KEYS[1] effect ids index (zset, all scores 0), KEYS[2] effectId -> taskId hash,
-- KEYS[3] the bucket's scheduler hash: refused FROZEN while its slot moves (common.lua), since
-- K.keyed_effect(id) is a key this script does not declare
-- ARGV[1] test clock (unused: nothing here is timed), ARGV[2] key prefix (the key layout's P),
-- ARGV[3] prefix (lowercase hex), ARGV[4] the most ids to return
-- Returns the ids, or {'ERR', 'FROZEN', detail}
local ids_index, effect_tasks = KEYS[1], KEYS[2]
local refused = check_not_frozen(KEYS[3])
if refused then return refused end
local prefix, want = ARGV[3], tonumber(ARGV[4])
local low, high = '[' .. prefix, '(' .. prefix .. 'g'
local BATCH, SCAN_MOST = 64, 1024
local out = {}
local offset = 0
while #out < want and offset < SCAN_MOST do
  local batch = redis.call('ZRANGEBYLEX', ids_index, low, high, 'LIMIT', offset, BATCH)
  for _, id in ipairs(batch) do
    if redis.call('HEXISTS', effect_tasks, id) == 1
        or redis.call('EXISTS', K.keyed_effect(id)) == 1 then
      out[#out + 1] = id
      if #out == want then break end
    end
  end
  if #batch < BATCH then break end
  offset = offset + BATCH
end
return out
