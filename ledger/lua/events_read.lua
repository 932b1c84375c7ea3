-- Read the change feed after a position (RedisStore.read_events; ledger/events.py). Positions
-- are the stream's entry ids. Every event after `after` is still there unless the stream's
-- max-deleted-entry-id (kept by events_trim.lua) is above it: then some are gone (410).
-- KEYS[1] event stream
-- ARGV[1] test clock (unused; every script run through RedisStore._script receives it),
-- ARGV[2] the position to read after ('' for the current end), ARGV[3] most events
-- Returns {'OK', position to go on from, id, body, id, body, ...} or {'GONE', max deleted id}
local key, after, limit = KEYS[1], ARGV[2], tonumber(ARGV[3])

if redis.call('EXISTS', key) == 0 then
  if after == '' then return {'OK', '0-0'} end
  return {'OK', after}
end
local flat = redis.call('XINFO', 'STREAM', key)
local info = {}
for i = 1, #flat, 2 do info[flat[i]] = flat[i + 1] end
if after == '' then return {'OK', info['last-generated-id']} end

-- Stream ids compare as (ms, seq); both fit a double exactly.
local function parts(id)
  local dash = string.find(id, '-', 1, true)
  return tonumber(string.sub(id, 1, dash - 1)), tonumber(string.sub(id, dash + 1))
end
local ams, aseq = parts(after)
local dms, dseq = parts(info['max-deleted-entry-id'])
if ams < dms or (ams == dms and aseq < dseq) then
  return {'GONE', info['max-deleted-entry-id']}
end
local out = {'OK', after}
for _, entry in ipairs(redis.call('XRANGE', key, '(' .. after, '+', 'COUNT', limit)) do
  out[#out + 1] = entry[1]
  out[#out + 1] = entry[2][2]
  out[2] = entry[1]
end
return out
