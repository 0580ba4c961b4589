--[[
  Appends an accepted operation to its lease's lane (or, for the sanctioned exception,
  puts it at the front without ever overtaking an executing operation).

  KEYS[1] lane list (job ids, head first)
  KEYS[2] lane executing hash {job, token}
  KEYS[3] lanes index (zset laneId -> last progress ms)
  ARGV[1] job id   ARGV[2] lane id   ARGV[3] now (ms)   ARGV[4] 'tail' | 'front'

  Returns 1 when the job is now the head and nothing executes, so the caller must hand it
  to the workers; 0 when it waits behind others.
]]
local list, exec, lanes = KEYS[1], KEYS[2], KEYS[3]
local jobId, laneId, now, mode = ARGV[1], ARGV[2], ARGV[3], ARGV[4]

redis.call('ZADD', lanes, 'NX', now, laneId)

if mode == 'front' then
  local executing = redis.call('HGET', exec, 'job')
  local head = redis.call('LINDEX', list, 0)
  if executing and head then
    -- Never alongside an executing operation: right behind it instead.
    redis.call('LINSERT', list, 'AFTER', head, jobId)
    return 0
  end
  redis.call('LPUSH', list, jobId)
  return 1
end

if redis.call('RPUSH', list, jobId) == 1 then
  return 1
end
return 0
