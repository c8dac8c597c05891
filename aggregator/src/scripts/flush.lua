-- One exactly-once flush into one shard group: fence check, duplicate check, validation, then
-- every write, all in one slot. Lua has no rollback, so nothing is written until every check passed.
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
      rejected[#rejected + 1] = tostring(base + i)
      rejected[#rejected + 1] = reason
    end
  end
end
check(4, n, function(i) return 8 + i end, 0)
check(4 + n, w, function(i) return 8 + n + 2 * i - 1 end, n)
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
    rejected[#rejected + 1] = tostring(n + w + j)
    rejected[#rejected + 1] = reason
  end
end
if #rejected > 1 then
  return rejected
end
for i = 1, 3 * r do
  redis.call('DEL', KEYS[3 + n + w + i])
end
for i = 1, n do
  redis.call('INCRBY', KEYS[3 + i], ARGV[8 + i])
end
-- A bucket key gets its expiry when this script creates it (the sum is then the delta alone); a
-- key that exists got it then, so most writes of a bucket cost one INCRBY.
for i = 1, w do
  local key = KEYS[3 + n + i]
  local delta = ARGV[8 + n + 2 * i - 1]
  if redis.call('INCRBY', key, delta) == tonumber(delta) then
    redis.call('PEXPIREAT', key, ARGV[8 + n + 2 * i])
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
