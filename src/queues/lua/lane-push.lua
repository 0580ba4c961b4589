--[[
  Appends an accepted operation to its lease's lane and, if it is the head with nothing
  executing, hands it to the workers. The sanctioned exception (mode 'front', used by
  force-stop) goes ahead of queued and backing-off operations, never alongside an
  executing one.

  KEYS[1] lane list (job ids, head first)   KEYS[2] lane executing hash {job, token}
  KEYS[3] lanes index (zset laneId -> last progress ms)   KEYS[4] fencing counter
  ARGV[1] job id   ARGV[2] lane id   ARGV[3] now (ms)   ARGV[4] 'tail' | 'front'
  ARGV[5] BullMQ job key prefix
  ARGV[6] coalescing key ('' for none): an identical request queued last and not yet
          started absorbs this one

  Returns {'queued'} when it waits behind others, {'next', jobId, handOffResult} when it was
  handed to the workers, or {'absorbed', existingJobId} (the caller drops its own job).
]]
local rcall = redis.call
local listKey, execKey, lanesKey, fenceKey = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local jobId, laneId, now, mode = ARGV[1], ARGV[2], ARGV[3], ARGV[4]

--- @include "hand-off"
local q = bullKeys(ARGV[5], false)

local coalesceKey, coalesceAs = listKey .. ':c', ARGV[6]
if coalesceAs ~= '' then
  -- Only the last queued request can absorb: one with other requests after it would
  -- change what the lease ends up in (stop, resume, stop is not stop, resume).
  local existing = rcall('HGET', coalesceKey, coalesceAs)
  if existing and rcall('LINDEX', listKey, -1) == existing then
    return {'absorbed', existing}
  end
  rcall('HSET', coalesceKey, coalesceAs, jobId, 'job:' .. jobId, coalesceAs)
end

rcall('ZADD', lanesKey, 'NX', now, laneId)
local executing = rcall('HGET', execKey, 'job')

if mode == 'front' then
  local head = rcall('LINDEX', listKey, 0)
  if executing and head then
    -- Right behind the executing head; if the head backs off for a retry, lane-yield
    -- moves this job in front of it.
    rcall('LINSERT', listKey, 'AFTER', head, jobId)
    rcall('HSET', execKey, 'front', jobId)
    return {'queued'}
  end
  rcall('LPUSH', listKey, jobId)
else
  if rcall('RPUSH', listKey, jobId) > 1 then
    return {'queued'}
  end
end
return {'next', jobId, handOff(q, execKey, fenceKey, jobId, listKey .. ':c')}
