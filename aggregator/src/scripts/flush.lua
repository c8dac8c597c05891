-- One exactly-once flush into one shard group: fence check, duplicate check, then every write,
-- all in one slot, all or nothing. Lua has no rollback: a write Redis can undo exactly (INCRBY) is
-- its own check and is undone if any other is refused; what it cannot undo (a reset's DEL, a
-- membership's SADD or SREM) is checked before anything is written.
--
-- KEYS[1] fence hash    KEYS[2] ledger hash    KEYS[3] watermark hash
-- KEYS[4 .. 3+n] counter keys of the n deltas
-- KEYS[4+n .. 3+n+w] bucket keys of the w window deltas
-- KEYS[4+n+w .. 3+n+w+3r] per reset: the counter's key, member set and compaction journal
-- KEYS[4+n+w+3r ..] per membership: the counter's member set, then its counter key
-- ARGV[1] partition field ("<topic>/<partition>")    ARGV[2] the writer's epoch
-- ARGV[3] the ledger entry the writer last saw here    ARGV[4] next offset (the entry after this write)
-- ARGV[5] watermark value to store, or '' to leave the watermark alone
-- ARGV[6] n, the number of deltas    ARGV[7] w, the number of window deltas
-- ARGV[8] r, the number of resets (their keys are deleted before anything is added)
-- ARGV[9 .. 8+n] one delta per counter key, in the same order
-- ARGV[9+n .. 8+n+2w] per bucket key: its delta, then when it expires (ms since the epoch)
-- ARGV[9+n+2w ..] per membership: the actor, then '1' (like) or '0' (unlike)
--
-- Returns {'ok'}, {'fenced', current epoch or '0'}, {'duplicate', ledger entry},
-- {'rolled_back', ledger entry} (the group lost writes the writer had seen land) or
-- {'rejected', index, reason, index, reason, ...} with 1-based indexes: deltas first, then
-- window deltas (index n + i), then memberships (index n + w + j).
local field = ARGV[1]
local fence = redis.call('HGET', KEYS[1], field)
if fence ~= ARGV[2] then
  return {'fenced', fence or '0'}
end
local applied = tonumber(redis.call('HGET', KEYS[2], field) or '-1')
if applied >= tonumber(ARGV[4]) then
  return {'duplicate', tostring(applied)}
end
if applied < tonumber(ARGV[3]) then
  return {'rolled_back', tostring(applied)}
end
local n = tonumber(ARGV[6])
local w = tonumber(ARGV[7])
local r = tonumber(ARGV[8])
local m = (#KEYS - 3 - n - w - 3 * r) / 2

-- Why `delta` cannot be added to `current` (the key's value as MGET returned it), or nil.
local function refusal(current, delta)
  if current then
    if not string.match(current, '^%-?%d+$') then
      return 'not_an_integer'
    elseif math.abs(tonumber(current) + delta) > 9.2e18 then
      return 'overflow'
    end
  end
  return nil
end

-- The values of KEYS[first .. last], read with one MGET (and one EXISTS) per 1,000 keys rather
-- than a command per key. MGET answers nil for a key of another type as for a missing key; if
-- any of those exists, TYPE tells them apart, key by key (rare: only tally writes these keys).
-- Returns the values, with `true` for a key of another type.
local function values(first, last)
  local out = {}
  for from = first, last, 1000 do
    local to = math.min(from + 999, last)
    local keys = {}
    for k = from, to do
      keys[#keys + 1] = KEYS[k]
    end
    local got = redis.call('MGET', unpack(keys))
    local absent = {}
    for i = 1, #keys do
      out[#out + 1] = got[i]
      if not got[i] then
        absent[#absent + 1] = i
      end
    end
    if #absent > 0 then
      local maybe = {}
      for _, i in ipairs(absent) do
        maybe[#maybe + 1] = keys[i]
      end
      if redis.call('EXISTS', unpack(maybe)) > 0 then
        for _, i in ipairs(absent) do
          if redis.call('TYPE', keys[i])['ok'] ~= 'none' then
            out[#out - #keys + i] = true
          end
        end
      end
    end
  end
  return out
end

local rejected = {'rejected'}
local function refuse(list, index, reason)
  list[#list + 1] = tostring(index)
  list[#list + 1] = reason
end
-- Checks KEYS[first .. first+count-1], whose deltas are ARGV[arg(i)], reporting index base + i.
local function check(first, count, arg, base)
  if count == 0 then
    return
  end
  local current = values(first, first + count - 1)
  for i = 1, count do
    local reason
    if current[i] == true then
      reason = 'wrong_type'
    else
      reason = refusal(current[i], tonumber(ARGV[arg(i)]))
    end
    if reason then
      refuse(rejected, base + i, reason)
    end
  end
end

-- Memberships are checked before anything is written: SADD and SREM cannot be undone as
-- cheaply as INCRBY. Their refusals are listed after the deltas'.
local refused_members = {}
local mk = 3 + n + w + 3 * r
local ma = 8 + n + 2 * w
for j = 1, m do
  local set = KEYS[mk + 2 * j - 1]
  local kind = redis.call('TYPE', set)['ok']
  local reason = nil
  if kind ~= 'none' and kind ~= 'set' then
    reason = 'wrong_type'
  else
    local counter = redis.pcall('GET', KEYS[mk + 2 * j])
    if type(counter) == 'table' then
      reason = 'wrong_type'
    else
      reason = refusal(counter, 1)
    end
  end
  if reason then
    refuse(refused_members, n + w + j, reason)
  end
end

if r > 0 or #refused_members > 0 then
  -- Resets delete keys, which cannot be undone, and a refused membership returns anyway: every
  -- delta is read and checked before anything is written, so the writes below take them all.
  check(4, n, function(i) return 8 + i end, 0)
  check(4 + n, w, function(i) return 8 + n + 2 * i - 1 end, n)
  for _, v in ipairs(refused_members) do
    rejected[#rejected + 1] = v
  end
  if #rejected > 1 then
    return rejected
  end
  for i = 1, 3 * r do
    redis.call('DEL', KEYS[3 + n + w + i])
  end
end
do
  -- Otherwise each INCRBY is its own check: reading and checking every key first was about a
  -- third of a 12,000-key script. A script runs alone, so if Redis refuses any delta, undoing
  -- the ones it took leaves nothing of this write behind.
  local refused = {}
  local function add(key, delta, index)
    local sum = redis.pcall('INCRBY', key, delta)
    if type(sum) == 'table' then
      local err = sum['err'] or ''
      local reason = 'not_an_integer'
      if string.find(err, 'WRONGTYPE', 1, true) then
        reason = 'wrong_type'
      elseif string.find(err, 'overflow', 1, true) then
        reason = 'overflow'
      end
      refuse(rejected, index, reason)
      refused[index] = true
    end
    return sum
  end
  for i = 1, n do
    add(KEYS[3 + i], ARGV[8 + i], i)
  end
  -- A bucket key gets its expiry when this script creates it (the sum is then the delta alone);
  -- a key that exists got it then, so most writes of a bucket cost one INCRBY.
  local created = {}
  for i = 1, w do
    local delta = ARGV[8 + n + 2 * i - 1]
    if add(KEYS[3 + n + i], delta, n + i) == tonumber(delta) then
      created[#created + 1] = i
    end
  end
  if #rejected > 1 then
    -- Redis's arithmetic restores each value exactly. A key left at 0 is deleted: it counts the
    -- same as no key, and an undone bucket must not stay without its expiry.
    -- The negated delta is built as text: Lua's numbers are doubles. It is an INCRBY, so the
    -- undo needs no other permission; -2^63 has no negation in 64 bits and is undone in two.
    local function undo(key, delta)
      local left
      if delta == '-9223372036854775808' then
        redis.call('INCRBY', key, '9223372036854775807')
        left = redis.call('INCRBY', key, 1)
      elseif delta == '0' then
        left = redis.call('INCRBY', key, 0)
      elseif string.sub(delta, 1, 1) == '-' then
        left = redis.call('INCRBY', key, string.sub(delta, 2))
      else
        left = redis.call('INCRBY', key, '-' .. delta)
      end
      if left == 0 then
        redis.call('DEL', key)
      end
    end
    for i = 1, n do
      if not refused[i] then
        undo(KEYS[3 + i], ARGV[8 + i])
      end
    end
    for i = 1, w do
      if not refused[n + i] then
        undo(KEYS[3 + n + i], ARGV[8 + n + 2 * i - 1])
      end
    end
    return rejected
  end
  for _, i in ipairs(created) do
    redis.call('PEXPIREAT', KEYS[3 + n + i], ARGV[8 + n + 2 * i])
  end
end
for j = 1, m do
  local set, counter = KEYS[mk + 2 * j - 1], KEYS[mk + 2 * j]
  local actor = ARGV[ma + 2 * j - 1]
  if ARGV[ma + 2 * j] == '1' then
    if redis.call('SADD', set, actor) == 1 then
      redis.call('INCRBY', counter, 1)
    end
  elseif redis.call('SREM', set, actor) == 1 then
    redis.call('INCRBY', counter, -1)
  end
end
redis.call('HSET', KEYS[2], field, ARGV[4])
if ARGV[5] ~= '' then
  redis.call('HSET', KEYS[3], field, ARGV[5])
end
return {'ok'}
