-- Compaction, step 1 (the source group's slot): take the counter's whole share there into a
-- journal, so that it is never in two places a reader would both count, nor in none.
-- KEYS[1] fence hash    KEYS[2] counter share    KEYS[3] journal    KEYS[4] resets hash
-- ARGV[1] the compactor's epoch    ARGV[2] a new move id
-- Returns {'fenced'}, {'lapsed'} (the group's mark lapsed: the compactor marks and settles again),
-- {'pending', journal} (a move from here is already under way: finish it
-- first), {'empty'} (nothing to move; a zero share is deleted) or {'taken', amount, move id}:
-- the move id is ARGV[2], followed, if the group recorded a reset of the counter while a
-- compactor moves shares (the resets hash's field of the share key, scripts/flush.lua), by '|'
-- and that record, which the give checks the base group has applied (compact_give.lua).
if redis.call('HGET', KEYS[1], 'compactor') ~= ARGV[1] then
  return {'fenced'}
end
-- The group's mark must be this compactor's and not lapsed (moving_lib.lua): while it is, every
-- reset applied here since the compactor settled is recorded.
if not mark_held_by(redis.call('HGET', KEYS[1], '~moving'), ARGV[1]) then
  return {'lapsed'}
end
local pending = redis.call('GET', KEYS[3])
if pending then
  return {'pending', pending}
end
local value = redis.call('GET', KEYS[2])
if not value then
  return {'empty'}
end
if not string.match(value, '^%-?%d+$') then
  return redis.error_reply('compaction: ' .. KEYS[2] .. ' holds ' .. value)
end
redis.call('DEL', KEYS[2])
if tonumber(value) == 0 then
  return {'empty'}
end
local id = ARGV[2]
local reset = redis.call('HGET', KEYS[4], KEYS[2])
if reset then
  id = id .. '|' .. reset
end
redis.call('SET', KEYS[3], id .. ':' .. value)
return {'taken', value, id}
