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
  ARGV[7] most operations a lane may hold (0: no limit; force-stops are never refused)
  ARGV[8] most operations the queue may hold waiting, parked or backing off, this one
          included (it is already parked when this runs); 0: no limit
  ARGV[9] '1' to adopt a job stored by an earlier enqueue that was cut short before its
          push (a retry with the same idempotency key): a job already in its lane, or one
          with an outcome, is left alone

  Returns {'queued'} when it waits behind others, {'next', jobId, handOffResult} when it was
  handed to the workers, {'absorbed', existingJobId} or {'full', 'lease' | 'queue', count}
  (in both cases the caller drops its own job), or {'present'} (adopting: nothing to do).
]]
local rcall = redis.call
local listKey, execKey, lanesKey, fenceKey = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local jobId, laneId, now, mode = ARGV[1], ARGV[2], ARGV[3], ARGV[4]

--- @include "hand-off"
local q = bullKeys(ARGV[5], false)

if ARGV[9] == '1' and (rcall('LPOS', listKey, jobId) or rcall('HEXISTS', q.jobPrefix .. jobId, 'lo:outcome') == 1) then
  return {'present'}
end

local coalesceKey, coalesceAs = listKey .. ':c', ARGV[6]
if coalesceAs ~= '' then
  -- Only the last queued request can absorb: one with other requests after it would
  -- change what the lease ends up in (stop, resume, stop is not stop, resume).
  local existing = rcall('HGET', coalesceKey, coalesceAs)
  if existing and rcall('LINDEX', listKey, -1) == existing then
    return {'absorbed', existing}
  end
end

-- Limits, checked in the same atomic step that would grow the lane and the queue.
local maxPerLane, maxQueued = tonumber(ARGV[7]), tonumber(ARGV[8])
if maxPerLane > 0 and mode ~= 'front' then
  local inLane = rcall('LLEN', listKey)
  if inLane >= maxPerLane then
    return {'full', 'lease', inLane}
  end
end
if maxQueued > 0 then
  local queued = rcall('ZCARD', q.delayed) + rcall('LLEN', q.wait)
  if queued > maxQueued then
    return {'full', 'queue', queued - 1}
  end
end

if coalesceAs ~= '' then
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
