-- Cells rewrites (tally_common::window::cells), shared by flush.lua and cells.lua: this file is
-- put before each of them when they are loaded. A rewrite is a hash and, per field, the value
-- the writer read ('' for none) and the one to write ('' to delete); it lands only if every field
-- still holds what was read.

-- The rewrites of the s hashes KEYS[first ..], described in ARGV from `arg`: per hash its expiry
-- (ms since the epoch, '' to leave it), f, then f times a field, its read value and its new one.
-- Returns them and the ARGV index after them.
local function cells_args(first, s, arg)
  local stripes = {}
  for i = 1, s do
    local stripe = {key = KEYS[first + i - 1], expire = ARGV[arg], fields = {}}
    local f = tonumber(ARGV[arg + 1])
    arg = arg + 2
    for j = 1, f do
      stripe.fields[j] = {ARGV[arg], ARGV[arg + 1], ARGV[arg + 2]}
      arg = arg + 3
    end
    stripes[i] = stripe
  end
  return stripes, arg
end

-- Whether a field no longer holds what the writer read (a hash of another type counts: the
-- writer's next read finds it).
local function cells_stale(stripes)
  for _, stripe in ipairs(stripes) do
    local names = {}
    for j, f in ipairs(stripe.fields) do
      names[j] = f[1]
    end
    local now = redis.pcall('HMGET', stripe.key, unpack(names))
    if now['err'] then
      return true
    end
    for j, f in ipairs(stripe.fields) do
      if (now[j] or '') ~= f[2] then
        return true
      end
    end
  end
  return false
end

-- Puts back what the first `upto` hashes held when read (each field held it before the write).
local function cells_restore(stripes, upto)
  for i = 1, upto do
    for _, f in ipairs(stripes[i].fields) do
      if f[2] == '' then
        redis.call('HDEL', stripes[i].key, f[1])
      else
        redis.call('HSET', stripes[i].key, f[1], f[2])
      end
    end
  end
end

-- Writes the new values: per hash one HSET and one HDEL. On an error Redis gives, puts back
-- what it wrote and returns the error; nil when all landed.
local function cells_write(stripes)
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
      cells_restore(stripes, i)
      return reply['err'] or 'unknown error'
    end
  end
  return nil
end

-- A hash lives as long as the last bucket written into it: NX for a new hash, then GT (only
-- ever later).
local function cells_expire(stripes)
  for _, stripe in ipairs(stripes) do
    if stripe.expire ~= '' and redis.call('PEXPIREAT', stripe.key, stripe.expire, 'NX') == 0 then
      redis.call('PEXPIREAT', stripe.key, stripe.expire, 'GT')
    end
  end
end

