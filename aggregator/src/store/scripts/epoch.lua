-- Takes the next epoch for a partition: one more than the last, and at least ARGV[2].
--
-- KEYS[1] epoch hash    ARGV[1] partition field    ARGV[2] lower bound
local epoch = redis.call('HINCRBY', KEYS[1], ARGV[1], 1)
if epoch < tonumber(ARGV[2]) then
  epoch = tonumber(ARGV[2])
  redis.call('HSET', KEYS[1], ARGV[1], epoch)
end
return tostring(epoch)
