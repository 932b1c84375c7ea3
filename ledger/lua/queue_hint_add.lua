-- Name a bucket in a queue's hint (ledger/cluster_store.py, ClusterStore._owed_hints), and
-- keep the hint from outliving its use: the field and the expiry in one step, so no hint is
-- left without an expiry. The value is a token fresh for every write, so a rescan that read
-- the field before this write cannot remove it (queue_hint_rescan.lua removes a field only
-- while it still holds the value the rescan read).
-- KEYS[1] the queue's hint (Keys.queue_buckets), in the queue's own bucket
-- ARGV[1] the bucket number, ARGV[2] a fresh token, ARGV[3] the expiry (ms)
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
