-- Stores a partition's watermark in its home group, if the writer still holds the fence there.
--
-- KEYS[1] fence hash    KEYS[2] watermark hash
-- ARGV[1] partition field    ARGV[2] the writer's epoch    ARGV[3] the watermark
--
-- Returns {'ok'} or {'fenced', current epoch or '0'}.
local fence = redis.call('HGET', KEYS[1], ARGV[1])
if fence ~= ARGV[2] then
  return {'fenced', fence or '0'}
end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
return {'ok'}
