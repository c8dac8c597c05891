-- A direct like in a namespace that deduplicates: add the actor to the counter's member set,
-- and count 1 in the counter's share only if it was not in it (and the deployment counts likes
-- in shares: where they are counted by their sets, the set is the count and KEYS[2] is absent).
-- A writer that counts likes grouped by counter in the shares also passes the group's fence
-- hash, and writes nothing once the group's likes were moved to count sets (its field '~likes',
-- `tally likes-to-sets`): it would count again likes counted by the sets.
-- KEYS[1] member set    KEYS[2] counter share (same group, same slot), if any    KEYS[3] the
-- group's fence hash, if checked    ARGV[1] actor
-- Returns 'moved' if the group's likes were moved;
-- else 1 if the like counted, 0 if it was already counted.
if KEYS[3] and redis.call('HGET', KEYS[3], '~likes') then
  return 'moved'
end
if redis.call('SADD', KEYS[1], ARGV[1]) == 1 then
  if KEYS[2] then
    redis.call('INCRBY', KEYS[2], 1)
  end
  return 1
end
return 0
