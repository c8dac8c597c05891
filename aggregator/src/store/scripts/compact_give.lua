-- Compaction, step 2 (the base group's slot): add a journaled amount to the base share, once.
-- KEYS[1] fence hash    KEYS[2] base share    KEYS[3] the applied-move marker for the source group
-- KEYS[4] ledger hash    KEYS[5] resets hash
-- ARGV[1] the compactor's epoch    ARGV[2] move id    ARGV[3] amount
-- ARGV[4] the base group's record of the counter's resets, as the compactor read it ('' for
-- none)    ARGV[5] 'cancel' if the source group had not applied one of them when the amount was
-- taken (the compactor read the source's ledger and journal since), 'give' otherwise
-- Returns 'fenced', 'lapsed' (the group's mark lapsed: the compactor marks and settles again),
-- 'already' (this move was applied before), 'given', 'cancelled' (the amount
-- predates a reset this group applied: it is dropped, the marker recording the move as
-- applied), 'changed' (a reset landed here since the compactor read: it decides again) or
-- 'behind' (the amount follows a reset the source group had applied and this group has not
-- yet: nothing is written, the compactor gives again later).
--
-- A reset is one write per group, so it may reach the two groups on either side of a take;
-- while a compactor moves shares, each group records each counter's last reset from each
-- partition as '<partition field> <offset>', joined by ';' (the resets hash's field of the
-- share key), and a group has applied a reset once its ledger entry for that partition is past
-- that offset. The move id carries the source group's record, after a '|'.
if redis.call('HGET', KEYS[1], 'compactor') ~= ARGV[1] then
  return 'fenced'
end
-- The group's mark must be this compactor's and not lapsed (moving_lib.lua): while it is, every
-- reset applied here since the compactor settled is recorded.
if not mark_held_by(redis.call('HGET', KEYS[1], '~moving'), ARGV[1]) then
  return 'lapsed'
end
if redis.call('GET', KEYS[3]) == ARGV[2] then
  return 'already'
end
if (redis.call('HGET', KEYS[5], KEYS[2]) or '') ~= ARGV[4] then
  return 'changed'
end
if ARGV[5] == 'cancel' then
  redis.call('SET', KEYS[3], ARGV[2])
  return 'cancelled'
end
for partition, offset in string.gmatch(string.match(ARGV[2], '|(.*)$') or '', '([^;]+) (%-?%d+)') do
  if tonumber(redis.call('HGET', KEYS[4], partition) or '-1') <= tonumber(offset) then
    return 'behind'
  end
end
local current = redis.call('GET', KEYS[2])
if current and math.abs(tonumber(current) + tonumber(ARGV[3])) > 9.2e18 then
  return redis.error_reply('compaction: ' .. KEYS[2] .. ' would overflow')
end
redis.call('INCRBY', KEYS[2], ARGV[3])
redis.call('SET', KEYS[3], ARGV[2])
return 'given'
