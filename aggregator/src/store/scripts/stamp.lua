-- Stamps a new owner's epoch into one group's fence for a partition, and reads that group's
-- ledger entry for it. An epoch not above the current fence is refused (the epoch counter rolled
-- back, or another owner is newer), and so is a writer that counts likes in the shares where
-- the group's likes were moved to count sets (the fence's field '~likes', `tally likes-to-sets`).
--
-- KEYS[1] fence hash    KEYS[2] ledger hash
-- ARGV[1] partition field    ARGV[2] the new epoch    ARGV[3] '1' if the writer counts likes
-- in the shares
--
-- Returns {'stamped', ledger entry or '-1'}, {'stale', current epoch} or {'moved'}.
if ARGV[3] == '1' and redis.call('HGET', KEYS[1], '~likes') then
  return {'moved'}
end
local current = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
if current >= tonumber(ARGV[2]) then
  return {'stale', tostring(current)}
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return {'stamped', redis.call('HGET', KEYS[2], ARGV[1]) or '-1'}
