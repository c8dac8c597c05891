-- A direct like in a namespace that deduplicates: add the actor to the counter's member set in
-- the actor's group, and count 1 there only if it was not in it.
-- KEYS[1] member set    KEYS[2] counter share (same group, same slot)    ARGV[1] actor
-- Returns 1 if the like counted, 0 if it was already counted.
if redis.call('SADD', KEYS[1], ARGV[1]) == 1 then
  redis.call('INCRBY', KEYS[2], 1)
  return 1
end
return 0
