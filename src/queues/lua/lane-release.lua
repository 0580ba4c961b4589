--[[
  Ends the executing head of a lane and names the next job to hand to the workers.
  Refused for a stale attempt: one whose token is no longer the lane's current one.
  The outcome is kept on the job hash so that a re-run of this job (a crash before BullMQ
  recorded completion) repeats it instead of calling the provider again.

  KEYS[1] lane list   KEYS[2] lane executing hash   KEYS[3] lanes index   KEYS[4] job hash
  ARGV[1] job id   ARGV[2] token   ARGV[3] outcome (JSON)   ARGV[4] lane id   ARGV[5] now

  Returns {'stale'} | {'next', jobId} | {'idle'}
]]
local list, exec, lanes, jobKey = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local jobId, token, outcome, laneId, now = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]

local holder = redis.call('HMGET', exec, 'job', 'token')
if holder[1] ~= jobId or holder[2] ~= token then
  return {'stale'}
end

-- The holder is always the head: only release and drop remove a head, and 'front'
-- pushes never go before an executing one.
redis.call('LPOP', list)
redis.call('DEL', exec)
if redis.call('EXISTS', jobKey) == 1 then
  redis.call('HSET', jobKey, 'lo:outcome', outcome)
end

local nextJob = redis.call('LINDEX', list, 0)
if nextJob then
  redis.call('ZADD', lanes, now, laneId)
  return {'next', nextJob}
end
redis.call('ZREM', lanes, laneId)
return {'idle'}
