--[[
  A force-stop absorbs a stop of its lease that is queued and not yet started: the stop's
  job becomes the force-stop (its data replaced) and moves to the front, as a force-stop
  does: ahead of queued and backing-off operations, never alongside an executing one.
  The stop's caller then gets the force-stop's receipt under the job it already holds.

  KEYS[1] lane list   KEYS[2] lane executing hash   KEYS[3] lanes index   KEYS[4] fencing counter
  ARGV[1] coalescing key of the stop   ARGV[2] the force-stop's job data (JSON)
  ARGV[3] lane id   ARGV[4] now (ms)   ARGV[5] BullMQ job key prefix

  Returns {'none'} when no such stop is queued, else {'queued', jobId} or {'next', jobId, r}.
]]
local rcall = redis.call
local listKey, execKey, lanesKey, fenceKey = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local coalesceKey = listKey .. ':c'

--- @include "hand-off"
local q = bullKeys(ARGV[5], false)

local stopJob = rcall('HGET', coalesceKey, ARGV[1])
if not stopJob or not rcall('LPOS', listKey, stopJob) then
  return {'none'}
end
local jobKey = q.jobPrefix .. stopJob
if rcall('EXISTS', jobKey) == 0 then
  return {'none'}
end
forgetCoalescing(coalesceKey, stopJob)
rcall('HSET', jobKey, 'data', ARGV[2], 'name', 'force-stop')
rcall('LREM', listKey, 1, stopJob)
rcall('ZADD', lanesKey, 'NX', ARGV[4], ARGV[3])

local executing = rcall('HGET', execKey, 'job')
local head = rcall('LINDEX', listKey, 0)
if executing and head then
  rcall('LINSERT', listKey, 'AFTER', head, stopJob)
  rcall('HSET', execKey, 'front', stopJob)
  return {'queued', stopJob}
end
rcall('LPUSH', listKey, stopJob)
return {'next', stopJob, handOff(q, execKey, fenceKey, stopJob, coalesceKey)}
