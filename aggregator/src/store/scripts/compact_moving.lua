-- Compaction: marks a group as having shares moved out of or into it, renews or removes the
-- mark, or forgets recorded resets. While the fence's '~moving' holds a compactor's mark,
-- '<epoch> <deadline>' (ms, by this server's clock), and the deadline has not passed, every
-- reset applied in the group records itself in the group's resets hash, under the counter's
-- share key (scripts/flush.lua and the transactions), which a move's give checks
-- (compact_give.lua). A mark past its deadline has lapsed (its compactor stopped renewing it,
-- killed or stalled): resets no longer record, and neither a take nor a give goes on in the
-- group until a compactor marks it again and settles. A mark of an earlier release, the epoch
-- alone, never lapses.
-- KEYS[1] fence hash    KEYS[2] resets hash
-- ARGV[1] the compactor's epoch    ARGV[2] 'set' (marks the group), 'renew' (moves the mark's
-- deadline, if the mark is this compactor's and has not lapsed), 'clear' (removes the mark, if
-- it is this compactor's) or 'forget'    ARGV[3] for 'set' and 'renew': the lease, in ms from
-- now; for 'forget', ARGV[3 ..]: pairs of a recorded reset's field and the value read there,
-- deleted unless the value changed since
-- Returns 'fenced', 'lapsed' (a renew too late) or how many records it deleted.
if redis.call('HGET', KEYS[1], 'compactor') ~= ARGV[1] then
  return 'fenced'
end
local mark = redis.call('HGET', KEYS[1], '~moving')
if ARGV[2] == 'set' or ARGV[2] == 'renew' then
  if ARGV[2] == 'renew' and not mark_held_by(mark, ARGV[1]) then
    return 'lapsed'
  end
  redis.call('HSET', KEYS[1], '~moving', ARGV[1] .. ' ' .. string.format('%d', now_ms() + tonumber(ARGV[3])))
  return 0
end
if ARGV[2] == 'clear' then
  if mark and string.match(mark, '^%d+') == ARGV[1] then
    redis.call('HDEL', KEYS[1], '~moving')
  end
  return 0
end
local deleted = 0
for i = 3, #ARGV - 1, 2 do
  if redis.call('HGET', KEYS[2], ARGV[i]) == ARGV[i + 1] then
    deleted = deleted + redis.call('HDEL', KEYS[2], ARGV[i])
  end
end
return deleted
