--[[
  Drops a lane's head that can no longer end by itself: its job was removed by an
  operator, or BullMQ finished it without the lane hearing of it (e.g. stalled too often).
  Conditional on the head still being that job, so a late call never drops a successor.

  KEYS[1] lane list   KEYS[2] lane executing hash   KEYS[3] lanes index
  ARGV[1] job id   ARGV[2] lane id   ARGV[3] now (ms)

  Returns {'moved'} | {'next', jobId} | {'idle'}
]]
local list, exec, lanes = KEYS[1], KEYS[2], KEYS[3]
local jobId, laneId, now = ARGV[1], ARGV[2], ARGV[3]

if redis.call('LINDEX', list, 0) ~= jobId then
  return {'moved'}
end
redis.call('LPOP', list)
if redis.call('HGET', exec, 'job') == jobId then
  redis.call('DEL', exec)
end

local nextJob = redis.call('LINDEX', list, 0)
if nextJob then
  redis.call('ZADD', lanes, now, laneId)
  return {'next', nextJob}
end
redis.call('ZREM', lanes, laneId)
return {'idle'}
