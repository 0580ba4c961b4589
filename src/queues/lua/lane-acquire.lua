--[[
  Called when an attempt starts. Only the lane's head may run; it gets a fresh fencing
  token, which supersedes any earlier attempt of the same job.

  KEYS[1] lane list   KEYS[2] lane holder   KEYS[3] lane coalescing   KEYS[4] lanes index
  KEYS[5] fencing counter   KEYS[6] failures   KEYS[7] failures by time   KEYS[8] backing off
  KEYS[9] BullMQ delayed   KEYS[10] BullMQ wait   KEYS[11] BullMQ meta   KEYS[12] BullMQ active
  KEYS[13] BullMQ marker   KEYS[14] BullMQ events
  KEYS[15] counted lanes   KEYS[16] queued by company   KEYS[17] queued by environment
  KEYS[18] paused lanes
  (see includes/lane.lua)
  KEYS[19] the job's hash   KEYS[20] the job's BullMQ lock
  KEYS[21] the job's company's reruns on their way (rerun-admit.lua): a rerun joining its lane
  is counted there from now on
  KEYS[22] the company's operations in their lanes, by deadline (lane-push.lua): a job that
  re-enters its lane here joins it as a pushed one does
  ARGV[1] job id   ARGV[2] lane id   ARGV[3] now (ms)   ARGV[4] the attempt's BullMQ lock token

  Returns one of
    {'run', token}     the job is the head: execute it
    {'park'}           the job waits behind others: park it again
    {'done', outcome}  the lane recorded this job's outcome and BullMQ never finished the job
                       (a crash between release and completion): repeat that outcome
    {'orphan'}         the job is in no lane and has no outcome: its enqueue never finished
    {'gone'}           the job was removed (its lane's repair drops it)
    {'stale'}          the attempt no longer holds the job's BullMQ lock: its worker froze
                       past the lock, and another may be running the job
  A job BullMQ had finished that runs again (an operator retried it) re-enters its lane like
  a new request (at the tail; a force-stop after the force-stops at the front): {'run',
  token} if that makes it the head, else {'park'};
  a failed acquire does not: {'done', a failure with code operation_not_rerunnable}.
]]
local rcall = redis.call
--- @include "lane"
local k = laneKeys(KEYS)
local jobKey = KEYS[19]
local jobId, laneId, now = ARGV[1], ARGV[2], ARGV[3]
local jobPrefix = string.sub(jobKey, 1, #jobKey - #jobId)

-- Not its turn: the attempt parks the job (BullMQ's delayed set, until its deadline), then
-- asks the lane's repair to hand it off if it became the head meanwhile. Marked parked and
-- no longer backing off (this retry has started) from here, so that if its worker dies
-- between those two steps, the sweep's repair hands it off instead of taking it for a head
-- backing off and leaving it until its deadline.
local function park()
  rcall('ZREM', k.backingOff, jobId)
  rcall('HSET', jobKey, 'lo:parked', '1')
  return {'park'}
end

local function run()
  rcall('ZREM', k.backingOff, jobId)
  local token = tostring(rcall('INCR', k.fence))
  rcall('HSET', k.holder, 'job', jobId, 'token', token)
  rcall('ZADD', k.lanes, now, laneId)
  rcall('HDEL', jobKey, 'lo:parked')
  return {'run', token}
end

-- Removed by an operator after a worker fetched it (its lock had lapsed): it never starts.
if rcall('EXISTS', jobKey) == 0 then
  return {'gone'}
end

-- Only the attempt that holds the job's lock asks on: a worker that froze between BullMQ
-- handing it the job and this step wakes after another worker took the job, and a token
-- for it would make the running attempt stale (its end refused while BullMQ completes the
-- job). Nothing changes for it here: not the holder, not the parked flag, not the outcome.
if rcall('GET', KEYS[20]) ~= ARGV[4] then
  return {'stale'}
end

-- Its outcome was recorded and BullMQ never finished it (a crash came between): repeat it,
-- wherever the job stands; a stray copy of it in the lane goes, handing off the next.
local recorded = rcall('HMGET', jobKey, 'lo:outcome', 'lo:released-atm')
local atm = rcall('HGET', jobKey, 'atm') or '0'
if recorded[1] and recorded[2] == atm then
  local wasHead = rcall('LINDEX', k.list, 0) == jobId
  if rcall('LREM', k.list, 0, jobId) > 0 then
    forgetCoalescing(k, jobId)
    if wasHead then
      if rcall('HGET', k.holder, 'job') == jobId then
        rcall('DEL', k.holder)
      end
      advanceLane(k, jobPrefix, laneId, false)
    end
  end
  recount(k, laneId)
  return {'done', recorded[1]}
end

local head = rcall('LINDEX', k.list, 0)
if head == jobId then
  local holder = rcall('HGET', k.holder, 'job')
  if holder and holder ~= jobId then
    return park()
  end
  -- A paused lane starts nothing new (its holder, handed off before the pause, still runs).
  if holder ~= jobId and rcall('HEXISTS', k.paused, laneId) == 1 then
    return park()
  end
  return run()
end
if head and rcall('LPOS', k.list, jobId) then
  return park()
end

if recorded[1] then
  -- BullMQ finished it and an operator retried it: it runs again, as a new request. But not a
  -- failed acquire (a raw BullMQ retry; lease-ops' own rerun refuses it): its clean-up ran,
  -- under an id made from the acquire's, so a second sandbox would have none. Failed again.
  local ok, outcome = pcall(cjson.decode, recorded[1])
  if ok and type(outcome) == 'table' and outcome.status == 'failed' and rcall('HGET', jobKey, 'name') == 'acquire' then
    return {'done', cjson.encode({status = 'failed', code = 'operation_not_rerunnable',
      error = 'operation_not_rerunnable: a failed acquire was cleaned up after; enqueue a new acquire instead'})}
  end
  rcall('HDEL', jobKey, 'lo:outcome', 'lo:released-atm', 'lo:front')
  rcall('ZADD', k.lanes, 'NX', now, laneId)
  local joined
  if rcall('HGET', jobKey, 'name') == 'force-stop' then
    -- As a new force-stop: ahead of queued operations, behind the force-stops already there
    -- (at the tail, a force-stop accepted after it would go ahead of it).
    joined = queueFront(k, jobPrefix, jobId) and 2 or 1
  else
    joined = rcall('RPUSH', k.list, jobId)
  end
  -- Counted under the scope its data names (an empty lane has no record to say it).
  local ok, data = pcall(cjson.decode, rcall('HGET', jobKey, 'data') or '')
  local lease = ok and type(data) == 'table' and type(data.lease) == 'table' and data.lease or {}
  if type(lease.companyId) == 'string' and type(lease.environmentId) == 'string' then
    rcall('ZREM', KEYS[21], lease.environmentId .. '\n' .. jobId)
    recount(k, laneId, lease.companyId, lease.environmentId)
    if tonumber(data.deadlineAt) then
      rcall('ZADD', KEYS[22], data.deadlineAt, jobId)
    end
  else
    recount(k, laneId)
  end
  if joined == 1 and rcall('HEXISTS', k.paused, laneId) == 0 then
    return run()
  end
  return park()
end
return {'orphan'}
