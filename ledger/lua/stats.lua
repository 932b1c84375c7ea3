-- Sizes for store_stats (mirror of what the SQL stores count), from the indexes the other
-- scripts keep and never a scan of the records; one script so that the counts are one
-- consistent instant and "due" and "live" are measured on the store's clock. Like gauges.lua,
-- a PREPARED past its deadline counts as UNKNOWN (ledger.effects.effective), and a tombstone
-- past its forget_at counts as absent (ledger.retention).
-- KEYS[1] tasks index, KEYS[2] leases index, KEYS[3] settled index, KEYS[4] effects index,
-- KEYS[5] prepared index, KEYS[6] unknown index, KEYS[7] awaiting-approval index,
-- KEYS[8] task tombstones index, KEYS[9] effect tombstones index, KEYS[10] event stream,
-- then KEYS[11..] the structures whose MEMORY USAGE is reported (bytes_detail)
-- ARGV[1] test clock (see now_ms), ARGV[2] settled_ms
-- Returns {tasks, claimed, settled, due, effects, prepared (running), unknown (incl. overdue),
--          awaiting, live task tombstones, live effect tombstones, events,
--          then one MEMORY USAGE per KEYS[11..] (0 for a missing key)}
local now = now_ms(ARGV[1])
local live = '(' .. s(now)
local overdue = redis.call('ZCOUNT', KEYS[5], '-inf', s(now))
local out = {
  redis.call('ZCARD', KEYS[1]),
  -- The leases index holds every CLAIMED task, its lease live or run out.
  redis.call('ZCARD', KEYS[2]),
  redis.call('ZCARD', KEYS[3]),
  redis.call('ZCOUNT', KEYS[3], '-inf', s(now - tonumber(ARGV[2]))),
  redis.call('ZCARD', KEYS[4]),
  redis.call('ZCOUNT', KEYS[5], live, '+inf'),
  redis.call('SCARD', KEYS[6]) + overdue,
  redis.call('SCARD', KEYS[7]),
  redis.call('ZCOUNT', KEYS[8], live, '+inf'),
  redis.call('ZCOUNT', KEYS[9], live, '+inf'),
  redis.call('XLEN', KEYS[10]),
}
for i = 11, #KEYS do
  out[#out + 1] = redis.call('MEMORY', 'USAGE', KEYS[i]) or 0
end
return out
