--[[
  A force-stop absorbs a stop of its lease that is queued and not yet started: the stop's
  job becomes the force-stop (its data replaced) and moves to the front, as a force-stop
  does: ahead of queued and backing-off operations, never alongside an executing one.
  The stop's caller then gets the force-stop's receipt under the job it already holds.
  Only a stop with nothing but force-stops ahead of it: moving one ahead of a resume would
  leave the sandbox running where the callers asked for it stopped. Not even an executing
  head: if it backs off, the force-stops behind it go ahead of it (lane-yield).

  KEYS[1] lane list   KEYS[2] lane holder   KEYS[3] lane coalescing   KEYS[4] lanes index
  KEYS[5] fencing counter   KEYS[6] failures   KEYS[7] failures by time   KEYS[8] backing off
  KEYS[9] BullMQ delayed   KEYS[10] BullMQ wait   KEYS[11] BullMQ meta   KEYS[12] BullMQ active
  KEYS[13] BullMQ marker   KEYS[14] BullMQ events
  KEYS[15] counted lanes   KEYS[16] queued by company   KEYS[17] queued by environment
  KEYS[18] paused lanes
  (see includes/lane.lua)
  KEYS[19] the request's idempotency key (a placeholder when it has none)
  KEYS[20] the lease's history
  ARGV[1] coalescing key of the stop   ARGV[2] the force-stop's job data (JSON)
  ARGV[3] lane id   ARGV[4] now (ms)   ARGV[5] BullMQ job key prefix
  ARGV[6] the force-stop's deadline (ms): a stop with a later one is not absorbed, its
  caller keeps the time it asked for   ARGV[7] the request's fingerprint   ARGV[8] '1' when
  it has an idempotency key: set to accepted, naming the stop's job, in this same step
  ARGV[10] how much later than the stop's the force-stop's deadline may be (ms): the stop's
  caller must not wait long past the deadline it asked for (as in lane-push's coalescing)
  ARGV[9] the stop's job id, as the caller read it (its data, ARGV[2], keeps that job's
  acceptedAt): another job under the key now is not absorbed

  Returns {'none'} when no such stop is queued, else {'queued', jobId} or {'next', jobId, r}.
]]
local rcall = redis.call
--- @include "lane"
--- @include "history"
local k = laneKeys(KEYS)

-- Heads removed through BullMQ's own API go first, as in lane-push: the force-stop must not
-- queue behind them. (On {'none'}, a parked head this exposes is left for the force-stop's
-- own push to go ahead of; the lane is dated now, so the sweep looks soon if it does not.)
local dropped = dropRemovedHeads(k, ARGV[5], ARGV[3], ARGV[4])

local stopJob = rcall('HGET', k.coalesce, ARGV[1])
if not stopJob or stopJob ~= ARGV[9] then
  return {'none'}
end
local position = rcall('LPOS', k.list, stopJob)
if not position then
  return {'none'}
end
if position > 0 then
  for _, ahead in ipairs(rcall('LRANGE', k.list, 0, position - 1)) do
    if rcall('HGET', ARGV[5] .. ahead, 'name') ~= 'force-stop' then
      return {'none'}
    end
  end
end
local jobKey = ARGV[5] .. stopJob
-- Parked and never started: a stop already handed to the workers stays as it is.
if rcall('EXISTS', jobKey) == 0 or rcall('HEXISTS', jobKey, 'processedOn') == 1 or not rcall('ZSCORE', KEYS[9], stopJob) then
  return {'none'}
end
local stopData = cjson.decode(rcall('HGET', jobKey, 'data'))
if type(stopData) ~= 'table' or not tonumber(stopData.deadlineAt) then
  return {'none'}
end
local stopDeadline = tonumber(stopData.deadlineAt)
if tonumber(ARGV[6]) < stopDeadline or tonumber(ARGV[6]) > stopDeadline + tonumber(ARGV[10]) then
  return {'none'}
end
forgetCoalescing(k, stopJob)
rcall('HSET', jobKey, 'data', ARGV[2], 'name', 'force-stop')
if ARGV[8] == '1' then
  rcall('SET', KEYS[19], cjson.encode({jobId = stopJob, fingerprint = ARGV[7], state = 'accepted'}), 'KEEPTTL')
end
rcall('LREM', k.list, 1, stopJob)
rcall('ZADD', k.lanes, 'NX', ARGV[4], ARGV[3])
historyAppend(KEYS[20], {'e', 'absorbed', 'job', stopJob, 'op', 'force-stop'})
if queueFront(k, ARGV[5], stopJob) then
  if dropped then
    handOffExposed(k, ARGV[5], ARGV[3])
  end
  return {'queued', stopJob}
end
-- The head now, perhaps ahead of one backing off: the lane's progress is now.
rcall('ZADD', k.lanes, 'XX', ARGV[4], ARGV[3])
return {'next', stopJob, handOff(k, ARGV[5], stopJob, false, ARGV[3])}
