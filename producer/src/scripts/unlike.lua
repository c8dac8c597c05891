-- A direct unlike in a namespace that deduplicates: remove the actor from the counter's member
-- set in the actor's group, and take 1 back there only if it was in it.
-- KEYS[1] member set    KEYS[2] counter share (same group, same slot)    ARGV[1] actor
-- Returns 1 if a counted like was taken back, 0 if there was none.
if redis.call('SREM', KEYS[1], ARGV[1]) == 1 then
  redis.call('INCRBY', KEYS[2], -1)
  return 1
end
return 0
