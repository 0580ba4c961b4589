--[[
  Called when an attempt starts. Only the lane's head may run; it gets a fresh fencing
  token, which supersedes any earlier attempt of the same job.

  KEYS[1] lane list   KEYS[2] lane executing hash   KEYS[3] fencing counter
  KEYS[4] lanes index KEYS[5] the BullMQ job hash
  ARGV[1] job id   ARGV[2] lane id   ARGV[3] now (ms)

  Returns one of
    {'run', token}     the job is the head: execute it
    {'park'}           the job waits behind others (e.g. promoted by hand): park it again
    {'done', outcome}  the lane already recorded this job's outcome (a re-run after a crash
                       between release and BullMQ's own completion): repeat that outcome
    {'orphan'}         the job is in no lane and has no outcome: its enqueue never finished
]]
local list, exec, fence, lanes, jobKey = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local jobId, laneId, now = ARGV[1], ARGV[2], ARGV[3]

local head = redis.call('LINDEX', list, 0)
if head == jobId then
  local holder = redis.call('HGET', exec, 'job')
  if holder and holder ~= jobId then
    return {'park'}
  end
  local token = tostring(redis.call('INCR', fence))
  redis.call('HSET', exec, 'job', jobId, 'token', token)
  redis.call('ZADD', lanes, now, laneId)
  return {'run', token}
end

if head and redis.call('LPOS', list, jobId) then
  return {'park'}
end

local outcome = redis.call('HGET', jobKey, 'lo:outcome')
if outcome then
  return {'done', outcome}
end
return {'orphan'}
