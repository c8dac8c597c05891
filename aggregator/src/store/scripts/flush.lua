-- One exactly-once flush into one shard group: fence check, duplicate check, then every write,
-- all in one slot, all or nothing. Lua has no rollback: a write Redis can undo exactly (INCRBY, a
-- hash field whose old value is known) is its own check and is undone if any other is refused;
-- what it cannot undo (a reset's DEL) is checked before anything is written. A counter's likes
-- are one run: one SADD of its likers, one SREM of its unlikers and one INCRBY by what they
-- changed, together; a run is its own check, and one already applied is simply found done when
-- the write is tried again (the set already holds its likers), so a refusal or failure after it
-- need not undo it. A run whose likes are counted by their set (ARGV[11]) is its SADD and SREM
-- alone: the counter's total is its share plus the set's SCARD, and no counter is written.
-- Such runs may also be written before this script, by the writer's plain SADDs and SREMs in
-- the same MULTI/EXEC (Lua costs about as much again per member): they are then checked here
-- and pass nothing but their flag. The writer sends them only while it watches the group's
-- fence, having read that it holds its epoch and that its ledger entry lets the write land, so
-- that they land only where this script is found ready to take the rest; and it ends them with
-- `DEL none`, `SET check 1` and `SINTERSTORE check none <their sets>`, which deletes the check
-- key unless one of the sets holds another type (Redis then refuses that run's SADD and SREM,
-- which write nothing, and the SINTERSTORE, which leaves the check key).
--
-- KEYS[1] fence hash    KEYS[2] ledger hash    KEYS[3] watermark hash
-- KEYS[4 .. 3+n] counter keys of the n deltas (packed: the hashes of their buckets)
-- KEYS[4+n .. 3+n+s] the s cells hashes (window buckets) this write rewrites fields of
-- KEYS[4+n+s .. 3+n+s+3r] per reset: the counter's key, its set (count or member set) and its
--   compaction journal; then, packed, per reset the hash of the counter's bucket; then, if there
--   are resets, the group's resets hash (recorded in while a compactor moves shares)
-- KEYS[4+n+s+3r(+r)(+1) ..] the sets of the runs of likes written here, then the counter keys
--   of those not counted by their sets, in the same order; then, if runs were written before
--   this script, the check key
-- ARGV[1] partition field ("<topic>/<partition>")    ARGV[2] the writer's epoch
-- ARGV[3] the ledger entry the writer last saw here    ARGV[4] next offset (the entry after this write)
-- ARGV[5] watermark value to store, or '' to leave the watermark alone
-- ARGV[6] n, the number of deltas, then '/' and the buckets per group if the writer packs the
--   deltas (the group's fence field '~packed' must hold the same: packed groups take deltas as
--   fields of their buckets' hashes, the counter id being the field)
-- ARGV[7] s, the number of cells hashes
-- ARGV[8] r, the number of resets (their keys are deleted before anything is added)
-- ARGV[9] w, the number of window deltas (memberships are numbered after them in a refusal)
-- ARGV[10] x, the number of window deltas the writer found refused
-- ARGV[11] per run of likes, '1' if it is counted by its set, '0' if its count is added to its
--   counter, '2' if it is counted by its set and was written before this script (m characters)
-- ARGV[12 .. 11+n] one delta per counter key, in the same order
-- then per cells hash: when it expires (ms since the epoch), f, then f times: a field (a
--   counter), the value the writer read ('' for none) and the value to write ('' to delete)
-- then x times: a refused window delta's index (n + its place among the window deltas) and why
-- then per run written here: l, u, then the l actors who like the counter and the u who unlike
-- it
-- then, packed, the n deltas' counters and the r resets' counters (their hashes' fields)
-- then the r resets' offsets (the last reset of each counter in the write)
--
-- The writer reads the cells fields and computes their new values (tally_common::window::cells);
-- if any field no longer holds what it read, the script writes nothing and returns {'stale'}, and
-- the writer reads again. Loaded after cells_lib.lua.
--
-- Returns {'ok'}, {'fenced', current epoch or '0'}, {'duplicate', ledger entry},
-- {'rolled_back', ledger entry} (the group lost writes the writer had seen land), {'stale'},
-- {'layout', the group's buckets or '0'} (the writer packs where the group does not, or the
-- other way round: it writes again as the group says),
-- {'sets_refused'} (a set of a run written before holds another type: the writer tries the
-- write again with this script alone, which finds which),
-- {'rejected', index, reason, index, reason, ...} with 1-based indexes: deltas first, then
-- window deltas (index n + i), then runs of likes (index n + w + k, w the window deltas), or
-- {'failed', error}.
--
-- A delta is rejected only for a reason read from the data: the key holds another type, a string
-- that is not a 64-bit integer, or a value the delta would take past 64 bits. Any other answer
-- from Redis (out of memory, read-only, no permission, anything unknown) is the store's trouble,
-- not the event's: the script undoes what it wrote and returns {'failed', error}, and the
-- aggregator retries the whole write.
local field = ARGV[1]
-- Whether runs were written before this script, and if so whether their check failed (which
-- deletes the check key either way).
local before = string.find(ARGV[11], '2', 1, true) ~= nil
local sets_refused = before and redis.call('DEL', KEYS[#KEYS]) == 1
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
if sets_refused then
  return {'sets_refused'}
end
local n, packing = string.match(ARGV[6], '^(%d+)/?(%d*)$')
n = tonumber(n)
do
  local packed = redis.call('HGET', KEYS[1], '~packed') or ''
  if packed ~= packing then
    return {'layout', packed == '' and '0' or packed}
  end
end
local packed = packing ~= ''
local s = tonumber(ARGV[7])
local r = tonumber(ARGV[8])
local w = tonumber(ARGV[9])
local x = tonumber(ARGV[10])
local m = #ARGV[11]
local mk = 3 + n + s + 3 * r
if packed then
  mk = mk + r
end
if r > 0 then
  -- The resets hash, KEYS[mk].
  mk = mk + 1
end

-- The cells rewrites: per hash, its expiry and where its {field, read, new} triples are.
local stripes, arg = cells_args(4 + n, s, 12 + n)
local refused_windows = {}
for i = 1, x do
  refused_windows[i] = {ARGV[arg], ARGV[arg + 1]}
  arg = arg + 2
end
local ma = arg - 1

-- The runs of likes: run k's set is KEYS[set_at[k]] and its counter KEYS[counter_at[k]] (none
-- when counted by its set; neither when written before); its l likers are ARGV[at[k] .. at[k]
-- + l - 1] and its u unlikers the u after them (none when written before).
local at, likes, unlikes, set_at, counter_at = {}, {}, {}, {}, {}
local counted = {}
local here = 0
-- Packed: the n deltas' fields are ARGV[tail .. tail+n-1], the r resets' the r after them.
local tail
do
  for k = 1, m do
    if string.byte(ARGV[11], k) ~= 50 then
      here = here + 1
      set_at[k] = mk + here
    end
  end
  local a = ma + 1
  for k = 1, m do
    if string.byte(ARGV[11], k) == 48 then
      counted[#counted + 1] = k
      counter_at[k] = mk + here + #counted
    end
    if set_at[k] then
      likes[k], unlikes[k] = tonumber(ARGV[a]), tonumber(ARGV[a + 1])
      at[k] = a + 2
      a = a + 2 + likes[k] + unlikes[k]
    else
      likes[k], unlikes[k], at[k] = 0, 0, a
    end
  end
  tail = a
end

-- A 64-bit integer as Redis reads one (string2ll: no sign but '-', no leading zero, no '-0'),
-- as {high, low}: high * 10^9 + low, both exact in Lua's doubles. nil if `s` is not one.
local function int64(s)
  local negative, digits = string.match(s, '^(%-?)([1-9]%d*)$')
  if not digits then
    if s == '0' then
      return {0, 0}
    end
    return nil
  end
  if #digits > 19 or (#digits == 19 and digits > (negative == '-' and '9223372036854775808' or '9223372036854775807')) then
    return nil
  end
  local high = tonumber(string.sub(digits, 1, -10)) or 0
  local low = tonumber(string.sub(digits, -9))
  if negative == '-' then
    return {-high, -low}
  end
  return {high, low}
end

-- Whether a + b (strings of 64-bit integers) is past 64 bits, computed exactly.
local function overflows(a, b)
  local x, y = int64(a), int64(b)
  local high, low = x[1] + y[1], x[2] + y[2]
  local carry = math.floor(low / 1e9)
  high, low = high + carry, low - carry * 1e9
  -- Now 0 <= low < 10^9; the range is [-9223372037 * 10^9 + 145224192, 9223372036 * 10^9 + 854775807].
  return high > 9223372036 or (high == 9223372036 and low > 854775807)
    or high < -9223372037 or (high == -9223372037 and low < 145224192)
end

-- Whether `current` (a counter key's value) is an integer Redis reads (no leading zero, no
-- '-0') of at most 15 characters: a run's likes and unlikes (far fewer than 10^15) cannot take
-- it past 64 bits, so the exact check below is only for values near the limits.
local function small_integer(current)
  return #current <= 15 and (current == '0' or string.find(current, '^%-?[1-9]%d*$') ~= nil)
end

-- Why `delta` cannot be added to `current` (the key's value as MGET returned it), or nil.
local function refusal(current, delta)
  if current then
    if not int64(current) then
      return 'not_an_integer'
    elseif overflows(current, delta) then
      return 'overflow'
    end
  end
  return nil
end

-- Whether the script's user may run each command it is about to (Redis 7's ACL check, with a
-- key of the kind each command writes), so that no write is refused half way through; an
-- error naming the first it may not, or nil.
local function forbidden(checks)
  if not redis.acl_check_cmd then
    return nil
  end
  for _, check in ipairs(checks) do
    if check[2] and not redis.acl_check_cmd(unpack(check)) then
      local denied = 'NOPERM the flush script may not run ' .. string.upper(check[1]) .. ' on '
      return denied .. check[2] .. ': its user lacks the permission'
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

-- The values of the first `count` deltas' fields (packed): an HGET each, `true` for a hash of
-- another type.
local function field_values(count)
  local out = {}
  for i = 1, count do
    local got = redis.pcall('HGET', KEYS[3 + i], ARGV[tail + i - 1])
    if type(got) == 'table' then
      if string.sub(got['err'] or '', 1, 10) ~= 'WRONGTYPE ' then
        return error(got['err'] or 'unknown error')
      end
      got = true
    end
    out[i] = got
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
  local current
  if packed then
    current = field_values(count)
  else
    current = values(first, first + count - 1)
  end
  for i = 1, count do
    local reason
    if current[i] == true then
      reason = 'wrong_type'
    else
      reason = refusal(current[i], ARGV[arg(i)])
    end
    if reason then
      refuse(rejected, base + i, reason)
    end
  end
end

do
  local denied = forbidden({
    {'incrby', n > 0 and not packed and KEYS[4] or nil, '1'},
    {'hincrby', n > 0 and packed and KEYS[4] or nil, 'x', '1'},
    {'hdel', n > 0 and packed and KEYS[4] or nil, 'x'},
    {'hdel', r > 0 and packed and KEYS[4 + n + s + 3 * r] or nil, 'x'},
    {'hset', s > 0 and KEYS[4 + n] or nil, 'x', '1'},
    {'hdel', s > 0 and KEYS[4 + n] or nil, 'x'},
    {'pexpireat', s > 0 and KEYS[4 + n] or nil, '0'},
    {'del', r > 0 and KEYS[4 + n + s] or nil},
    {'hset', r > 0 and KEYS[3 + n + s + 3 * r + (packed and r or 0) + 1] or nil, 'x', '1'},
    {'sadd', here > 0 and KEYS[mk + 1] or nil, 'x'},
    {'srem', here > 0 and KEYS[mk + 1] or nil, 'x'},
    -- Runs written before: the check key stands for their sets (same kind of key, same user).
    {'sadd', before and KEYS[#KEYS] or nil, 'x'},
    {'srem', before and KEYS[#KEYS] or nil, 'x'},
    {'incrby', #counted > 0 and KEYS[mk + here + 1] or nil, '1'},
    {'hset', KEYS[2], field, '0'},
    {'hset', ARGV[5] ~= '' and KEYS[3] or nil, field, '0'},
  })
  if denied then
    return {'failed', denied}
  end
end

-- The cells fields must still hold what the writer read, or it reads again. A hash of another
-- type is stale too: the writer's read then finds it, and refuses its window deltas.
if x == 0 and cells_stale(stripes) then
  return {'stale'}
end

-- Each run's counter (none when counted by its set) is checked before anything is written (one
-- MGET per 1,000): its likes may add up to l and its unlikes take u. Where a reset, a refused
-- window delta or a refused run makes everything be checked first, each run's set is too;
-- otherwise a set of another type is found by its SADD or SREM, which then write nothing.
-- Refusals are listed after the deltas'.
local refused_members = {}
local slow = r > 0 or x > 0
if m > 0 and (slow or #counted > 0) then
  -- The counters' values, by run (nil for a run counted by its set).
  local current = {}
  for i, v in ipairs(values(mk + here + 1, mk + here + #counted)) do
    current[counted[i]] = v
  end
  local function check_runs(sets_too)
    local refused = {}
    for k = 1, m do
      local reason = nil
      local value = current[k]
      if value == true then
        reason = 'wrong_type'
      elseif value and not small_integer(value) then
        if likes[k] > 0 then
          reason = refusal(value, tostring(likes[k]))
        end
        if not reason and unlikes[k] > 0 then
          reason = refusal(value, '-' .. unlikes[k])
        end
      end
      -- A run written before was checked by its SINTERSTORE.
      if not reason and sets_too and set_at[k] then
        local kind = redis.call('TYPE', KEYS[set_at[k]])['ok']
        if kind ~= 'none' and kind ~= 'set' then
          reason = 'wrong_type'
        end
      end
      if reason then
        refuse(refused, n + w + k, reason)
      end
    end
    return refused
  end
  refused_members = check_runs(slow)
  if #refused_members > 0 and not slow then
    -- Returning refusals anyway: the sets' too, so that one refusal lists them all.
    refused_members = check_runs(true)
  end
end

if r > 0 or x > 0 or #refused_members > 0 then
  -- Resets delete keys, which cannot be undone, and refused window deltas or memberships
  -- return anyway: every delta is read and checked before anything is written, so the writes
  -- below take them all.
  check(4, n, function(i) return 11 + i end, 0)
  for _, v in ipairs(refused_windows) do
    refuse(rejected, v[1], v[2])
  end
  for _, v in ipairs(refused_members) do
    rejected[#rejected + 1] = v
  end
  if #rejected > 1 then
    return rejected
  end
  for i = 1, 3 * r do
    redis.call('DEL', KEYS[3 + n + s + i])
  end
  if packed then
    for i = 1, r do
      redis.call('HDEL', KEYS[3 + n + s + 3 * r + i], ARGV[tail + n + i - 1])
    end
  end
  -- While a compactor moves shares (the fence's '~moving'), each reset leaves where it was
  -- in the log, which a move's give compares with the source group's ledger
  -- (compact_give.lua): the resets hash's field of the counter's key holds
  -- '<partition> <offset>' of its last reset from each partition, joined by ';'. A mark whose
  -- deadline passed (compact_moving.lua) has lapsed: its compactor stopped, and records nothing.
  if r > 0 and mark_holds(redis.call('HGET', KEYS[1], '~moving')) then
    local resets = KEYS[3 + n + s + 3 * r + (packed and r or 0) + 1]
    for i = 1, r do
      local share = KEYS[3 + n + s + 3 * i - 2]
      local entries = {}
      for entry in string.gmatch(redis.call('HGET', resets, share) or '', '[^;]+') do
        if string.sub(entry, 1, #field + 1) ~= field .. ' ' then
          entries[#entries + 1] = entry
        end
      end
      entries[#entries + 1] = field .. ' ' .. ARGV[#ARGV - r + i]
      redis.call('HSET', resets, share, table.concat(entries, ';'))
    end
  end
end
-- The runs of likes, before the deltas: a run that Redis refuses writes nothing, and one that
-- landed needs no undo (see the top). Members go in slices of 1,000 (Lua's unpack has a limit).
-- Returns how many members it changed, and the error that stopped it, if any.
local function members(command, set, from, count)
  local changed = 0
  for first = from, from + count - 1, 1000 do
    local got = redis.pcall(command, set, unpack(ARGV, first, math.min(first + 999, from + count - 1)))
    if type(got) == 'table' then
      return changed, got['err'] or 'unknown error'
    end
    changed = changed + got
  end
  return changed, nil
end
do
  local refused_runs = false
  for k = 1, m do
    local set, a, l, u = KEYS[set_at[k]], at[k], likes[k], unlikes[k]
    local counter = counter_at[k] and KEYS[counter_at[k]]
    local added, removed, err = 0, 0, nil
    if l > 0 then
      added, err = members('SADD', set, a, l)
    end
    if not err and u > 0 then
      removed, err = members('SREM', set, a + l, u)
    end
    if counter and added ~= removed then
      -- Checked above: the counter takes any sum of its run. Counted even when an error
      -- stopped the run half way, so that its set and its count always agree.
      redis.call('INCRBY', counter, added - removed)
    end
    if err then
      if string.sub(err, 1, 10) == 'WRONGTYPE ' and added == 0 and removed == 0 then
        refuse(rejected, n + w + k, 'wrong_type')
        refused_runs = true
      else
        return {'failed', err}
      end
    end
  end
  if refused_runs then
    -- Only without refused window deltas or resets: those checked every set first.
    return rejected
  end
end
do
  -- Otherwise each INCRBY is its own check: reading and checking every key first was about a
  -- third of a 12,000-key script. A script runs alone, so if Redis refuses any delta, undoing
  -- the ones it took leaves nothing of this write behind.
  -- Only a refusal Redis gives about the data rejects a delta: WRONGTYPE (the key holds another
  -- type), the overflow error (the sum is past 64 bits), and "not an integer" once GET shows a
  -- string that is not one. Any other error (OOM, READONLY, NOPERM, unknown) fails the write.
  local refused = {}
  local failure = nil
  local done = 0
  local function add(key, delta, index)
    local sum
    if packed then
      sum = redis.pcall('HINCRBY', key, ARGV[tail + index - 1], delta)
    else
      sum = redis.pcall('INCRBY', key, delta)
    end
    if type(sum) == 'table' then
      local err = sum['err'] or 'unknown error'
      local reason = nil
      if string.sub(err, 1, 10) == 'WRONGTYPE ' then
        reason = 'wrong_type'
      elseif err == 'ERR increment or decrement would overflow' then
        reason = 'overflow'
      elseif packed and err == 'ERR hash value is not an integer' then
        local value = redis.pcall('HGET', key, ARGV[tail + index - 1])
        if type(value) == 'string' and not int64(value) then
          reason = 'not_an_integer'
        end
      elseif not packed and err == 'ERR value is not an integer or out of range' then
        local value = redis.pcall('GET', key)
        if type(value) == 'string' and not int64(value) then
          reason = 'not_an_integer'
        end
      end
      if not reason then
        failure = err
        return nil
      end
      refuse(rejected, index, reason)
      refused[index] = true
    end
    done = index
    return sum
  end
  for i = 1, n do
    add(KEYS[3 + i], ARGV[11 + i], i)
    if failure then
      break
    end
  end
  -- The cells: each hash's new fields in one HSET, its emptied ones in one HDEL.
  if not failure and #rejected == 1 then
    -- On an error it has already put back what it wrote.
    failure = cells_write(stripes)
  end
  if failure or #rejected > 1 then
    -- Redis's arithmetic restores each value exactly. A key left at 0 is deleted: it counts the
    -- same as no key.
    -- The negated delta is built as text: Lua's numbers are doubles. It is an INCRBY (or, of a
    -- field, an HINCRBY), so the undo needs no other permission; -2^63 has no negation in 64
    -- bits and is undone in two. A field left at 0 is deleted likewise.
    local function undo(i)
      local key, delta = KEYS[3 + i], ARGV[11 + i]
      local function by(amount)
        if packed then
          return redis.call('HINCRBY', key, ARGV[tail + i - 1], amount)
        end
        return redis.call('INCRBY', key, amount)
      end
      local left
      if delta == '-9223372036854775808' then
        by('9223372036854775807')
        left = by(1)
      elseif delta == '0' then
        left = by(0)
      elseif string.sub(delta, 1, 1) == '-' then
        left = by(string.sub(delta, 2))
      else
        left = by('-' .. delta)
      end
      if left == 0 then
        if packed then
          redis.call('HDEL', key, ARGV[tail + i - 1])
        else
          redis.call('DEL', key)
        end
      end
    end
    for i = 1, math.min(n, done) do
      if not refused[i] then
        undo(i)
      end
    end
    if failure then
      return {'failed', failure}
    end
    return rejected
  end
  cells_expire(stripes)
end
redis.call('HSET', KEYS[2], field, ARGV[4])
if ARGV[5] ~= '' then
  redis.call('HSET', KEYS[3], field, ARGV[5])
end
return {'ok'}
