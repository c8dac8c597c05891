-- Rewrites cells fields (window buckets, tally_common::window::cells) for at-least-once writes,
-- the sweep and the migration, only if each still holds what the writer read: all of them, or
-- none and {'stale'} (the writer reads again). Every key is in one shard group (one slot).
-- Loaded after cells_lib.lua.
--
-- KEYS[1 .. s] the cells hashes    KEYS[s+1 ..] keys to delete with the rewrite (the migration's
-- old bucket keys), each only if it still holds the value given for it
-- ARGV[1] s; then per hash: when it expires (ms since the epoch; '' to leave its expiry), f, then
-- f times: a field, the value the writer read ('' for none) and the value to write ('' to
-- delete); then per key to delete, its value
--
-- Returns {'ok'}, {'stale'}, or {'failed', error} (nothing written).
local s = tonumber(ARGV[1])
local stripes, arg = cells_args(1, s, 2)
for i = s + 1, #KEYS do
  if redis.call('GET', KEYS[i]) ~= ARGV[arg + i - s - 1] then
    return {'stale'}
  end
end
if cells_stale(stripes) then
  return {'stale'}
end
local failure = cells_write(stripes)
if failure then
  return {'failed', failure}
end
for i = s + 1, #KEYS do
  redis.call('DEL', KEYS[i])
end
cells_expire(stripes)
return {'ok'}
