-- Compaction: marks a group as having shares moved out of or into it, removes the mark, or
-- forgets recorded resets. While the fence's '~moving' is set, every reset applied in the group
-- records itself in the group's resets hash, under the counter's share key (scripts/flush.lua
-- and the transactions), which a move's give checks (compact_give.lua).
-- KEYS[1] fence hash    KEYS[2] resets hash
-- ARGV[1] the compactor's epoch    ARGV[2] 'set' (marks the group), 'clear' (removes the mark,
-- if it is this compactor's) or 'forget'    ARGV[3 ..] pairs of a recorded reset's field and
-- the value read there: deleted unless the value changed since
-- Returns 'fenced' or how many records it deleted.
if redis.call('HGET', KEYS[1], 'compactor') ~= ARGV[1] then
  return 'fenced'
end
if ARGV[2] == 'set' then
  redis.call('HSET', KEYS[1], '~moving', ARGV[1])
elseif ARGV[2] == 'clear' and redis.call('HGET', KEYS[1], '~moving') == ARGV[1] then
  redis.call('HDEL', KEYS[1], '~moving')
end
local deleted = 0
for i = 3, #ARGV - 1, 2 do
  if redis.call('HGET', KEYS[2], ARGV[i]) == ARGV[i + 1] then
    deleted = deleted + redis.call('HDEL', KEYS[2], ARGV[i])
  end
end
return deleted
