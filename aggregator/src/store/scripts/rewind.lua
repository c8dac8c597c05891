-- Moves a partition's ledger entry in one group back to where its log was truncated (an unclean
-- leader election: the records from there on are new), if the writer still holds the fence.
--
-- KEYS[1] fence hash    KEYS[2] ledger hash
-- ARGV[1] partition field    ARGV[2] the writer's epoch    ARGV[3] the offset to move back to
--
-- Returns {'ok'} or {'fenced', current epoch or '0'}.
local fence = redis.call('HGET', KEYS[1], ARGV[1])
if fence ~= ARGV[2] then
  return {'fenced', fence or '0'}
end
local ledger = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '-1')
if ledger > tonumber(ARGV[3]) then
  redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
end
return {'ok'}
