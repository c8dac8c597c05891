-- Before a batch's group writes, in the partition's home group: decide each expiry record of the
-- batch (or take the decision an earlier attempt of the batch recorded), record it, and move the
-- partition's idle index. The Rust twin is `Transactions::mark_idle`; the rule is
-- `expiry::expires`.
--
-- KEYS[1] fence hash    KEYS[2] watermark hash    KEYS[3] the partition's idle index (sorted set)
-- KEYS[4] the partition's recorded decisions (hash: offset -> '1' expired, '0' kept)
-- ARGV[1] partition field    ARGV[2] the writer's epoch    ARGV[3] e, the number of records
-- ARGV[4 .. 3+4e] per record: its offset, the counter, its deadline, and the latest idle
--   deadline of the counter's events earlier in the batch ('' if none)
-- ARGV[4+4e ..] per counter the batch wrote: the counter, then its latest idle deadline
--
-- Returns {'ok', d1, d2, ...} with '1' (expired) or '0' (kept) per record, or
-- {'fenced', current epoch or '0'}.
local field = ARGV[1]
local fence = redis.call('HGET', KEYS[1], field)
if fence ~= ARGV[2] then
  return {'fenced', fence or '0'}
end
-- Decisions behind the watermark are never asked for again.
local watermark = redis.call('HGET', KEYS[2], field)
if watermark then
  local resume = tonumber(string.match(watermark, '^%-?%d+'))
  for _, offset in ipairs(redis.call('HKEYS', KEYS[4])) do
    if tonumber(offset) < resume then
      redis.call('HDEL', KEYS[4], offset)
    end
  end
end
local e = tonumber(ARGV[3])
local out = {'ok'}
for i = 0, e - 1 do
  local offset, counter = ARGV[4 + 4 * i], ARGV[5 + 4 * i]
  local deadline, held = tonumber(ARGV[6 + 4 * i]), ARGV[7 + 4 * i]
  local decided = redis.call('HGET', KEYS[4], offset)
  if not decided then
    local last = redis.call('ZSCORE', KEYS[3], counter)
    last = last and tonumber(last)
    if held ~= '' then
      last = math.max(last or tonumber(held), tonumber(held))
    end
    if last and last <= deadline then
      decided = '1'
    else
      decided = '0'
    end
    redis.call('HSET', KEYS[4], offset, decided)
  end
  if decided == '1' then
    redis.call('ZREM', KEYS[3], counter)
  elseif held ~= '' then
    redis.call('ZADD', KEYS[3], 'GT', held, counter)
  end
  out[#out + 1] = decided
end
local first = 4 + 4 * e
for from = first, #ARGV, 1000 do
  local args = {}
  for k = from, math.min(from + 999, #ARGV), 2 do
    args[#args + 1] = ARGV[k + 1]
    args[#args + 1] = ARGV[k]
  end
  redis.call('ZADD', KEYS[3], 'GT', unpack(args))
end
return out
