-- Rewrites cells fields (window buckets, tally_common::window::cells) for at-least-once writes,
-- the sweep and the migration, only if each still holds what the writer read: all of them, or
-- none and {'stale'} (the writer reads again). Every key is in one shard group (one slot).
--
-- KEYS[1 .. s] the cells hashes    KEYS[s+1 ..] keys to delete with the rewrite (the migration's
-- old bucket keys), each only if it still holds the value given for it
-- ARGV[1] s; then per hash: when it expires (ms since the epoch; '' to leave its expiry), f, then
-- f times: a field, the value the writer read ('' for none) and the value to write ('' to
-- delete); then per key to delete, its value
--
-- Returns {'ok'}, {'stale'}, or {'failed', error} (nothing written).
local s = tonumber(ARGV[1])
local stripes = {}
local arg = 2
for i = 1, s do
  local stripe = {key = KEYS[i], expire = ARGV[arg], fields = {}}
  local f = tonumber(ARGV[arg + 1])
  arg = arg + 2
  for j = 1, f do
    stripe.fields[j] = {ARGV[arg], ARGV[arg + 1], ARGV[arg + 2]}
    arg = arg + 3
  end
  stripes[i] = stripe
end
for i = s + 1, #KEYS do
  if redis.call('GET', KEYS[i]) ~= ARGV[arg + i - s - 1] then
    return {'stale'}
  end
end
for _, stripe in ipairs(stripes) do
  local names = {}
  for j, f in ipairs(stripe.fields) do
    names[j] = f[1]
  end
  local now = redis.pcall('HMGET', stripe.key, unpack(names))
  if now['err'] then
    return {'stale'}
  end
  for j, f in ipairs(stripe.fields) do
    if (now[j] or '') ~= f[2] then
      return {'stale'}
    end
  end
end
local written = 0
local failure = nil
for i, stripe in ipairs(stripes) do
  local set, del = {}, {}
  for _, f in ipairs(stripe.fields) do
    if f[3] == '' then
      del[#del + 1] = f[1]
    else
      set[#set + 1] = f[1]
      set[#set + 1] = f[3]
    end
  end
  -- HSET and HDEL answer a number, or an error as {err = ...}.
  local reply = 0
  if #set > 0 then
    reply = redis.pcall('HSET', stripe.key, unpack(set))
  end
  if #del > 0 and type(reply) ~= 'table' then
    reply = redis.pcall('HDEL', stripe.key, unpack(del))
  end
  if type(reply) == 'table' then
    failure = reply['err'] or 'unknown error'
    break
  end
  written = i
end
if failure then
  for i = 1, written do
    for _, f in ipairs(stripes[i].fields) do
      if f[2] == '' then
        redis.call('HDEL', stripes[i].key, f[1])
      else
        redis.call('HSET', stripes[i].key, f[1], f[2])
      end
    end
  end
  return {'failed', failure}
end
for i = s + 1, #KEYS do
  redis.call('DEL', KEYS[i])
end
for _, stripe in ipairs(stripes) do
  if stripe.expire ~= '' and redis.call('PEXPIREAT', stripe.key, stripe.expire, 'NX') == 0 then
    redis.call('PEXPIREAT', stripe.key, stripe.expire, 'GT')
  end
end
return {'ok'}
