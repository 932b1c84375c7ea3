-- Replace one effect record only if it is still exactly what the caller read (compare and
-- set). Operator and reconciler transitions (resolve, approve, probes, expiry sweeps) are
-- decided in Python by ledger.effects and written through this script; the hot path
-- (prepare, complete) has its own scripts.
-- KEYS[1] the task's effects hash (a keyed effect's own hash), KEYS[2] prepared index,
-- KEYS[3] unknown index, KEYS[4] awaiting-approval index, KEYS[5] probe-due index,
-- KEYS[6] event stream, KEYS[7] keyed-settled index, KEYS[8] keyed-prepared index,
-- KEYS[9] keyed-unknown index
-- ARGV[1] effectId, ARGV[2] the record as read (cjson text, '' for none), ARGV[3] the new
-- record (JSON text)
-- Returns 1 when written, 0 when the record changed in between (the caller reads again).
local effects_key = KEYS[1]
local index = effect_indexes(KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8],
                             KEYS[9])
local effect_id, read_raw, new_raw = ARGV[1], ARGV[2], ARGV[3]

local current = redis.call('HGET', effects_key, effect_id)
if current ~= read_raw then return 0 end
redis.call('HSET', effects_key, effect_id, new_raw)
local e = cjson.decode(new_raw)
index_effect(index, e)
local was = ''
if read_raw ~= '' then was = cjson.decode(read_raw).state end
if was ~= e.state then effect_event(index, e) end
return 1
