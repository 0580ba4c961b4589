--[[
  Appends an accepted operation to its lease's lane and, if it is the head with nothing
  executing, hands it to the workers. A force-stop ('front') goes ahead of queued and
  backing-off operations, never alongside an executing one.

  KEYS[1] lane list   KEYS[2] lane holder   KEYS[3] lane coalescing   KEYS[4] lanes index
  KEYS[5] fencing counter   KEYS[6] failures   KEYS[7] failures by time   KEYS[8] backing off
  KEYS[9] BullMQ delayed   KEYS[10] BullMQ wait   KEYS[11] BullMQ meta   KEYS[12] BullMQ active
  KEYS[13] BullMQ marker   KEYS[14] BullMQ events   (see includes/lane.lua)
  KEYS[15] the job's hash   KEYS[16] the request's idempotency key (a placeholder when it has none)
  ARGV[1] job id   ARGV[2] lane id   ARGV[3] now (ms)   ARGV[4] 'tail' | 'front'
  ARGV[5] BullMQ job key prefix
  ARGV[6] coalescing key ('' for none): an identical request queued last and not yet
          started absorbs this one
  ARGV[7] most operations a lane may hold (0: no limit; force-stops are never refused)
  ARGV[8] most operations the queue may hold waiting, parked or backing off, this one
          included (it is already parked when this runs); 0: no limit
  ARGV[9] '1' when the job was stored by an earlier request with the same idempotency key
          (a retry finishing an enqueue cut short)
  ARGV[10] the request's fingerprint (kept with its idempotency key)   ARGV[11] '1' when
  the request has an idempotency key (KEYS[16] is then that key)
  A job already in its lane, or one with an outcome, is left alone when either of ARGV[9] and
  ARGV[11] is set: two requests with one key may both get here (a retry while the first was
  slow), and the job must join its lane once.

  Returns {'queued'} when it waits behind others, {'next', jobId, handOffResult} when it was
  handed to the workers, {'absorbed', existingJobId} or {'full', 'lease' | 'queue', count}
  (in both cases the caller drops its own job), or {'present'} (already accepted).
]]
local rcall = redis.call
--- @include "lane"
local k = laneKeys(KEYS)
local jobKey, idemKey = KEYS[15], KEYS[16]
local jobId, laneId, now, mode, jobPrefix = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]

-- The idempotency key, once its request's job is in a lane (its own, or the one that absorbed it).
local function accepted(acceptedJobId)
  if ARGV[11] == '1' then
    rcall('SET', idemKey, cjson.encode({jobId = acceptedJobId, fingerprint = ARGV[10], state = 'accepted'}), 'KEEPTTL')
  end
end

if (ARGV[9] == '1' or ARGV[11] == '1') and (rcall('LPOS', k.list, jobId) or rcall('HEXISTS', jobKey, 'lo:outcome') == 1) then
  accepted(jobId)
  return {'present'}
end

local coalesceAs = ARGV[6]
if coalesceAs ~= '' then
  -- Only the last queued request can absorb: one with other requests after it would
  -- change what the lease ends up in (stop, resume, stop is not stop, resume).
  local existing = rcall('HGET', k.coalesce, coalesceAs)
  if existing and rcall('LINDEX', k.list, -1) == existing then
    accepted(existing)
    return {'absorbed', existing}
  end
end

-- Limits, checked in the same atomic step that would grow the lane and the queue.
local maxPerLane, maxQueued = tonumber(ARGV[7]), tonumber(ARGV[8])
if maxPerLane > 0 and mode ~= 'front' then
  local inLane = rcall('LLEN', k.list)
  if inLane >= maxPerLane then
    return {'full', 'lease', inLane}
  end
end
if maxPerLane > 0 and mode == 'front' then
  -- A force-stop goes ahead of a full lane; only force-stops of its own lease count
  -- against it.
  -- Counted as queueFront places them: after an executing head that is not one of them.
  local head = rcall('LINDEX', k.list, 0)
  local from = (head and rcall('HEXISTS', k.holder, 'job') == 1 and rcall('HEXISTS', jobPrefix .. head, 'lo:front') == 0) and 1 or 0
  local last = frontBlockEnd(k, jobPrefix, from)
  local fronts = last and (rcall('LPOS', k.list, last) + 1 - from) or 0
  if fronts >= maxPerLane then
    return {'full', 'lease', fronts}
  end
end
if maxQueued > 0 then
  -- Force-stops have room of their own above the limit (a tenth of it, at least 100), so
  -- a backlog of other operations never keeps one out; past that room they are refused too.
  local limit = mode == 'front' and (maxQueued + math.max(100, math.floor(maxQueued / 10))) or maxQueued
  local queued = rcall('ZCARD', k.delayed) + rcall('LLEN', k.wait)
  if queued > limit then
    return {'full', 'queue', queued - 1}
  end
end

if coalesceAs ~= '' then
  rcall('HSET', k.coalesce, coalesceAs, jobId, 'job:' .. jobId, coalesceAs)
end
rcall('ZADD', k.lanes, 'NX', now, laneId)
accepted(jobId)

local waits
if mode == 'front' then
  waits = queueFront(k, jobPrefix, jobId)
else
  waits = rcall('RPUSH', k.list, jobId) > 1
end
if waits then
  rcall('HSET', jobKey, 'lo:parked', '1')
  return {'queued'}
end
-- It is the head now: if it went ahead of a head backing off, the lane's progress (dated
-- when that retry comes due) is now.
if mode == 'front' then
  rcall('ZADD', k.lanes, 'XX', now, laneId)
end
return {'next', jobId, handOff(k, jobPrefix, jobId, false)}
