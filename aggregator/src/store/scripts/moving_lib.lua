-- The moving mark ('~moving' in a group's fence hash, tally_common::layout::MOVING_FIELD),
-- shared by flush.lua and the compaction scripts: this file is put before each of them when they
-- are loaded. A compactor's mark is '<epoch> <deadline>', the deadline in ms by this server's
-- clock, moved ahead while the compactor runs (compact_moving.lua); an earlier release's mark is
-- the epoch alone, and never lapses.

-- This server's clock, in ms since the epoch.
local function now_ms()
  local time = redis.call('TIME')
  return tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
end

-- Whether `mark` (false for none) holds: resets applied in its group record themselves.
local function mark_holds(mark)
  if not mark then
    return false
  end
  local deadline = string.match(mark, ' (%d+)$')
  return not deadline or tonumber(deadline) >= now_ms()
end

-- Whether `mark` is compactor `epoch`'s and has not lapsed.
local function mark_held_by(mark, epoch)
  local owner, deadline = string.match(mark or '', '^(%d+) (%d+)$')
  return owner == epoch and tonumber(deadline) >= now_ms()
end

