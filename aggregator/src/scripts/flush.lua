-- One exactly-once flush into one shard group: fence check, duplicate check, validation, then
-- every write, all in one slot. Lua has no rollback, so nothing is written until every check passed.
--
-- KEYS[1] fence hash    KEYS[2] ledger hash    KEYS[3] watermark hash    KEYS[4..] counter keys
-- ARGV[1] partition field ("<topic>/<partition>")    ARGV[2] the writer's epoch
-- ARGV[3] the ledger entry the writer last saw here    ARGV[4] next offset (the entry after this write)
-- ARGV[5] watermark value to store, or '' to leave the watermark alone
-- ARGV[6..] one delta per counter key, in the same order
--
-- Returns {'ok'}, {'fenced', current epoch or '0'}, {'duplicate', ledger entry},
-- {'rolled_back', ledger entry} (the group lost writes the writer had seen land) or
-- {'rejected', index, reason, index, reason, ...} with 1-based counter indexes.
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
local rejected = {'rejected'}
for i = 4, #KEYS do
  local current = redis.pcall('GET', KEYS[i])
  local reason = nil
  if type(current) == 'table' then
    reason = 'wrong_type'
  elseif current then
    if not string.match(current, '^%-?%d+$') then
      reason = 'not_an_integer'
    elseif math.abs(tonumber(current) + tonumber(ARGV[i + 2])) > 9.2e18 then
      reason = 'overflow'
    end
  end
  if reason then
    rejected[#rejected + 1] = tostring(i - 3)
    rejected[#rejected + 1] = reason
  end
end
if #rejected > 1 then
  return rejected
end
for i = 4, #KEYS do
  redis.call('INCRBY', KEYS[i], ARGV[i + 2])
end
redis.call('HSET', KEYS[2], field, ARGV[4])
if ARGV[5] ~= '' then
  redis.call('HSET', KEYS[3], field, ARGV[5])
end
return {'ok'}
