-- Replace one effect record only if it is still exactly what the caller read (compare and
-- set). Operator and reconciler transitions (resolve, approve, probes, expiry sweeps) are
-- decided in Python by ledger.effects and written through this script; the hot path
-- (prepare, complete) has its own scripts.
-- KEYS[1] the task's effects hash, KEYS[2] prepared index, KEYS[3] unknown index,
-- KEYS[4] awaiting-approval index, KEYS[5] probe-due index
-- ARGV[1] effectId, ARGV[2] the record as read (cjson text), ARGV[3] the new record (JSON text)
-- Returns 1 when written, 0 when the record changed in between (the caller reads again).
local current = redis.call('HGET', KEYS[1], ARGV[1])
if current ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
EFFECT_INDEX = {prepared = KEYS[2], unknown = KEYS[3], awaiting = KEYS[4],
  probe_due = KEYS[5]}
index_effect(cjson.decode(ARGV[3]))
return 1
