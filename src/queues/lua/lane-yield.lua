--[[
  The executing head backs off before a retry: it keeps its place at the head, but is no
  longer executing. Force-stops that arrived while it executed (waiting right behind it) now
  go ahead of it, in the order they came, and the first is handed off.

  KEYS[1] lane list   KEYS[2] lane holder   KEYS[3] lane coalescing   KEYS[4] lanes index
  KEYS[5] fencing counter   KEYS[6] failures   KEYS[7] failures by time   KEYS[8] backing off
  KEYS[9] BullMQ delayed   KEYS[10] BullMQ wait   KEYS[11] BullMQ meta   KEYS[12] BullMQ active
  KEYS[13] BullMQ marker   KEYS[14] BullMQ events
  KEYS[15] counted lanes   KEYS[16] queued by company   KEYS[17] queued by environment
  KEYS[18] paused lanes
  (see includes/lane.lua)
  ARGV[1] job id   ARGV[2] token   ARGV[3] BullMQ job key prefix   ARGV[4] when its retry
  comes due (ms): it is listed as backing off until its next attempt starts
  ARGV[5] lane id: a lane waiting out a backoff shows progress due then, so the sweep (which
  reads lanes quiet since a while) passes it by until its retry is late; an operator's
  removal of the head in Bull Board is repaired by the API at once, one through BullMQ's own
  API by the lease's next enqueue (lane-push drops removed heads) or the sweep once the
  retry is late
  ARGV[6] now (ms)
  KEYS[19] the lease's history   ARGV[7] the backoff's history entry, its fields already joined
  (see lease-history.ts), or '' for none

  Returns 1, or 0 for a stale attempt.
]]
local rcall = redis.call
--- @include "lane"
--- @include "history"
local k = laneKeys(KEYS)

local holder = rcall('HMGET', k.holder, 'job', 'token')
if holder[1] ~= ARGV[1] or holder[2] ~= ARGV[2] then
  return 0
end
rcall('DEL', k.holder)
rcall('ZADD', k.backingOff, ARGV[4], ARGV[1])
-- Backing off, not parked (a flag left by a frozen attempt's late repair would let a repair
-- hand it off before its retry is due).
rcall('HDEL', ARGV[3] .. ARGV[1], 'lo:parked')
if ARGV[7] ~= '' then
  historyAppendJoined(KEYS[19], ARGV[7])
end
-- A backing-off front job keeps its place: front jobs keep their order among themselves.
if rcall('HEXISTS', ARGV[3] .. ARGV[1], 'lo:front') == 1 then
  rcall('ZADD', k.lanes, 'XX', ARGV[4], ARGV[5])
  return 1
end
local last = frontBlockEnd(k, ARGV[3], 1)
if not last then
  -- Nothing goes ahead of it: the lane waits for this retry.
  rcall('ZADD', k.lanes, 'XX', ARGV[4], ARGV[5])
  return 1
end
do
  local waiting = rcall('LRANGE', k.list, 1, rcall('LPOS', k.list, last))
  for i = 1, #waiting do
    rcall('LREM', k.list, 1, waiting[i])
  end
  for i = #waiting, 1, -1 do
    rcall('LPUSH', k.list, waiting[i])
  end
  -- The force-stops go now: the lane's progress is now, not when this retry comes due.
  rcall('ZADD', k.lanes, 'XX', ARGV[6], ARGV[5])
  advanceLane(k, ARGV[3], ARGV[5], false)
end
return 1
