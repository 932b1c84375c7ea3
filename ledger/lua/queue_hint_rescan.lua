-- Write a queue's rebuilt hint (ledger/cluster_store.py, ClusterStore._rescan_hint) in one
-- step: take out the buckets the rescan found empty, but only those whose field still holds
-- the token the rescan read before it looked at the buckets (a step that filled a bucket
-- since then wrote a new token after its step, queue_hint_add.lua: its bucket stays), add
-- the buckets found full, and stamp the rescan's store time. Atomic, so no claim ever reads a
-- fresh stamp over a removal that is still being checked, and a rescan that fails before
-- this changes nothing (the stale stamp makes the next claim rescan).
-- KEYS[1] the queue's hint (Keys.queue_buckets), in the queue's own bucket
-- ARGV[1] the rescan's store time (ms), ARGV[2] the expiry (ms), ARGV[3] a fresh token,
-- ARGV[4] how many removals follow: then bucket, token read, ... ; then the buckets to add
local key = KEYS[1]
local removals = tonumber(ARGV[4])
local i = 5
for _ = 1, removals do
  if redis.call('HGET', key, ARGV[i]) == ARGV[i + 1] then redis.call('HDEL', key, ARGV[i]) end
  i = i + 2
end
local fields = {'scanned_at', ARGV[1]}
for j = i, #ARGV do
  fields[#fields + 1] = ARGV[j]
  fields[#fields + 1] = ARGV[3]
end
redis.call('HSET', key, unpack(fields))
redis.call('PEXPIRE', key, ARGV[2])
return 1
