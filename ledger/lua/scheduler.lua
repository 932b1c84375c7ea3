-- Bump the epoch or set the claims-paused flag, answering the whole record.
-- KEYS[1] scheduler hash
-- ARGV[1] 'bump' | 'pause' | 'resume' | 'read'
-- Returns {epoch, paused(0|1)}
local epoch, paused = scheduler(KEYS[1])
if ARGV[1] == 'bump' then
  epoch = epoch + 1
elseif ARGV[1] == 'pause' then
  paused = true
elseif ARGV[1] == 'resume' then
  paused = false
end
if ARGV[1] ~= 'read' then
  redis.call('HSET', KEYS[1], 'epoch', s(epoch), 'paused', paused and '1' or '0')
end
return {s(epoch), paused and '1' or '0'}
