-- Compaction, steps 3 and 4: drop a journal (source slot) or an applied-move marker (base slot)
-- that holds the given move id, once the move is complete.
-- KEYS[1] fence hash    KEYS[2] the journal or marker
-- ARGV[1] the compactor's epoch    ARGV[2] move id
-- Returns 'fenced', 'done' or 'gone' (it held another move, or nothing).
if redis.call('HGET', KEYS[1], 'compactor') ~= ARGV[1] then
  return 'fenced'
end
local held = redis.call('GET', KEYS[2])
if held and (held == ARGV[2] or string.sub(held, 1, #ARGV[2] + 1) == ARGV[2] .. ':') then
  redis.call('DEL', KEYS[2])
  return 'done'
end
return 'gone'
