-- One exactly-once flush into one shard group: fence check, duplicate check, validation, then
-- every write, all in one slot. Lua has no rollback, so nothing is written until every check passed.
--
-- KEYS[1] fence hash    KEYS[2] ledger hash    KEYS[3] watermark hash
-- KEYS[4 .. 3+n] counter keys of the n deltas
-- KEYS[4+n ..] per membership: the counter's member set, then its counter key
-- ARGV[1] partition field ("<topic>/<partition>")    ARGV[2] the writer's epoch
-- ARGV[3] the ledger entry the writer last saw here    ARGV[4] next offset (the entry after this write)
-- ARGV[5] watermark value to store, or '' to leave the watermark alone
-- ARGV[6] n, the number of deltas    ARGV[7 .. 6+n] one delta per counter key, in the same order
-- ARGV[7+n ..] per membership: the actor, then '1' (like) or '0' (unlike)
--
-- Returns {'ok'}, {'fenced', current epoch or '0'}, {'duplicate', ledger entry},
-- {'rolled_back', ledger entry} (the group lost writes the writer had seen land) or
-- {'rejected', index, reason, index, reason, ...} with 1-based indexes: deltas first, then
-- memberships (index n + j).
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
local m = (#KEYS - 3 - n) / 2

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
if n > 0 then
  local current = values(4, 3 + n)
  for i = 1, n do
    local reason
    if current[i] == true then
      reason = 'wrong_type'
    else
      reason = refusal(current[i], tonumber(ARGV[6 + i]))
    end
    if reason then
      rejected[#rejected + 1] = tostring(i)
      rejected[#rejected + 1] = reason
    end
  end
end
for j = 1, m do
  local set = KEYS[3 + n + 2 * j - 1]
  local kind = redis.call('TYPE', set)['ok']
  local reason = nil
  if kind ~= 'none' and kind ~= 'set' then
    reason = 'wrong_type'
  else
    local counter = redis.pcall('GET', KEYS[3 + n + 2 * j])
    if type(counter) == 'table' then
      reason = 'wrong_type'
    else
      reason = refusal(counter, 1)
    end
  end
  if reason then
    rejected[#rejected + 1] = tostring(n + j)
    rejected[#rejected + 1] = reason
  end
end
if #rejected > 1 then
  return rejected
end
for i = 1, n do
  redis.call('INCRBY', KEYS[3 + i], ARGV[6 + i])
end
for j = 1, m do
  local set, counter = KEYS[3 + n + 2 * j - 1], KEYS[3 + n + 2 * j]
  local actor = ARGV[6 + n + 2 * j - 1]
  if ARGV[6 + n + 2 * j] == '1' then
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
