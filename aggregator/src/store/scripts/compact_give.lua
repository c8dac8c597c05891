-- Compaction, step 2 (the base group's slot): add a journaled amount to the base share, once.
-- KEYS[1] fence hash    KEYS[2] base share    KEYS[3] the applied-move marker for the source group
-- ARGV[1] the compactor's epoch    ARGV[2] move id    ARGV[3] amount
-- Returns 'fenced', 'already' (this move was applied before) or 'given'.
if redis.call('HGET', KEYS[1], 'compactor') ~= ARGV[1] then
  return 'fenced'
end
if redis.call('GET', KEYS[3]) == ARGV[2] then
  return 'already'
end
local current = redis.call('GET', KEYS[2])
if current and math.abs(tonumber(current) + tonumber(ARGV[3])) > 9.2e18 then
  return redis.error_reply('compaction: ' .. KEYS[2] .. ' would overflow')
end
redis.call('INCRBY', KEYS[2], ARGV[3])
redis.call('SET', KEYS[3], ARGV[2])
return 'given'
