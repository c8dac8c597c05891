-- Cells rewrites (tally_common::window::cells), shared by flush.lua and cells.lua: this file is
-- put before each of them when they are loaded. A rewrite is a hash and, per field, the value
-- the writer read ('' for none) and the one to write ('' to delete); it lands only if every field
-- still holds what was read.

-- The rewrites of the s hashes KEYS[first ..], described in ARGV from `arg`: per hash its expiry
-- (ms since the epoch, '' to leave it), f, then f times a field, its read value and its new one.
-- Returns, per hash, its key, expiry, field count and where its fields start in ARGV (field j's
-- triple is ARGV[at + 3j - 3 .. at + 3j - 1]: no table per field, a flush has tens of thousands),
-- and the ARGV index after them.
local function cells_args(first, s, arg)
  local stripes = {}
  for i = 1, s do
    local f = tonumber(ARGV[arg + 1])
    stripes[i] = {key = KEYS[first + i - 1], expire = ARGV[arg], f = f, at = arg + 2}
    arg = arg + 2 + 3 * f
  end
  return stripes, arg
end

-- Fields per HMGET, HSET or HDEL: Lua's unpack gives at most about 8,000 values, and a hash of
-- a deployment with few stripes (or a raised catch-up batch size) can take more fields than that
-- in one write.
local CELLS_SLICE = 1000

-- Whether a field no longer holds what the writer read (a hash of another type counts: the
-- writer's next read finds it).
local function cells_stale(stripes)
  for _, stripe in ipairs(stripes) do
    local names, at = {}, stripe.at
    for j = 1, stripe.f do
      names[j] = ARGV[at + 3 * j - 3]
    end
    for first = 1, stripe.f, CELLS_SLICE do
      local last = math.min(first + CELLS_SLICE - 1, stripe.f)
      local now = redis.pcall('HMGET', stripe.key, unpack(names, first, last))
      if now['err'] then
        return true
      end
      for j = first, last do
        if (now[j - first + 1] or '') ~= ARGV[at + 3 * j - 2] then
          return true
        end
      end
    end
  end
  return false
end

-- Puts back what the first `upto` hashes held when read (each field held it before the write).
local function cells_restore(stripes, upto)
  for i = 1, upto do
    local key, at = stripes[i].key, stripes[i].at
    for j = 1, stripes[i].f do
      local field, read = ARGV[at + 3 * j - 3], ARGV[at + 3 * j - 2]
      if read == '' then
        redis.call('HDEL', key, field)
      else
        redis.call('HSET', key, field, read)
      end
    end
  end
end

-- Writes the new values: per hash one HSET and one HDEL (per slice of fields). On an error Redis
-- gives, puts back what it wrote and returns the error; nil when all landed.
local function cells_write(stripes)
  for i, stripe in ipairs(stripes) do
    local set, del, at = {}, {}, stripe.at
    for j = 1, stripe.f do
      local field, value = ARGV[at + 3 * j - 3], ARGV[at + 3 * j - 1]
      if value == '' then
        del[#del + 1] = field
      else
        set[#set + 1] = field
        set[#set + 1] = value
      end
    end
    -- HSET and HDEL answer a number, or an error as {err = ...}.
    local reply = 0
    for first = 1, #set, 2 * CELLS_SLICE do
      if type(reply) == 'table' then
        break
      end
      reply = redis.pcall('HSET', stripe.key, unpack(set, first, math.min(first + 2 * CELLS_SLICE - 1, #set)))
    end
    for first = 1, #del, CELLS_SLICE do
      if type(reply) == 'table' then
        break
      end
      reply = redis.pcall('HDEL', stripe.key, unpack(del, first, math.min(first + CELLS_SLICE - 1, #del)))
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
