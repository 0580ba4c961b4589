--[[
  Ends the executing head of a lane and hands off the next job, in one atomic step.
  Refused for a stale attempt: one whose token is no longer the lane's current one.
  The outcome is kept on the job hash so that a re-run of this job (a crash before BullMQ
  recorded completion) repeats it instead of calling the provider again.

  A failed outcome is also noted in the failures hash (lane id -> "<ms> <job id>"), which
  lists leases whose last operation failed; the lane's next success clears it.

  KEYS[1] lane list   KEYS[2] lane executing hash   KEYS[3] lanes index   KEYS[4] fencing counter
  KEYS[5] failures hash
  ARGV[1] job id   ARGV[2] token   ARGV[3] outcome (JSON)   ARGV[4] lane id   ARGV[5] now
  ARGV[6] BullMQ job key prefix   ARGV[7] '1' when BullMQ's completion follows on this
  connection (see lazyMarker in includes/hand-off.lua)   ARGV[8] '1' when the outcome is a failure

  Returns {'stale'} | {'next', jobId, handOffResult} | {'idle'}
]]
local rcall = redis.call
local listKey, execKey, lanesKey, fenceKey = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local jobId, token, outcome, laneId, now = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]

--- @include "hand-off"
local q = bullKeys(ARGV[6], ARGV[7] == '1')

local holder = rcall('HMGET', execKey, 'job', 'token')
if holder[1] ~= jobId or holder[2] ~= token then
  return {'stale'}
end

-- The holder is always the head: only release and repair remove a head, and 'front'
-- pushes never go before an executing one.
rcall('LPOP', listKey)
rcall('DEL', execKey)
-- When BullMQ's completion follows, this attempt holds the job's lock, so the job exists;
-- otherwise check, so a removed job is not brought back as a stray hash.
local jobKey = q.jobPrefix .. jobId
if q.lazyMarker or rcall('EXISTS', jobKey) == 1 then
  rcall('HSET', jobKey, 'lo:outcome', outcome)
end
if ARGV[8] == '1' then
  rcall('HSET', KEYS[5], laneId, now .. ' ' .. jobId)
else
  rcall('HDEL', KEYS[5], laneId)
end
return advanceLane(q, listKey, execKey, fenceKey, lanesKey, laneId, now)
