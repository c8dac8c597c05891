-- A direct unlike in a namespace that deduplicates: remove the actor from the counter's member
-- set, and take 1 back from the counter's share only if it was in it (and the deployment counts
-- likes in shares: where they are counted by their sets, KEYS[2] is absent).
-- KEYS[1] member set    KEYS[2] counter share (same group, same slot), if any    ARGV[1] actor
-- Returns 1 if a counted like was taken back, 0 if there was none.
if redis.call('SREM', KEYS[1], ARGV[1]) == 1 then
  if KEYS[2] then
    redis.call('INCRBY', KEYS[2], -1)
  end
  return 1
end
return 0
