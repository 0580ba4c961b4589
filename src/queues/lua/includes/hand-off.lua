--[[
  Hands a lane's new head to the workers, in the same atomic step that made it the head.

  The job waits parked in BullMQ's delayed set; this moves it to the wait list exactly as
  BullMQ's own promote does (wait list, marker, event, delay field), so any worker picks it
  up at once. It also names the job the lane's holder with a fresh fencing token and leaves
  that token in the job's progress field: the worker that starts this first attempt can run
  it without asking the lane again.

  Expects `rcall`, and `q` from bullKeys() below. With lazyMarker (a release that BullMQ's completion of the same job follows
  on the same connection), the marker that wakes idle workers is left out when this job is
  the only one waiting: BullMQ's fetch-next in that completion takes it, and waking another
  worker would only make it race for nothing.
  Returns 'promoted', 'missing' (the job was removed), or 'elsewhere' (not parked: already
  waiting, or active while it parks; it then asks the lane itself).
]]
-- BullMQ's keys of the queue whose job keys start with `jobPrefix` ('<prefix>:<queue>:').
-- They share the lane keys' hash tag, so they live in the same Cluster slot.
local function bullKeys(jobPrefix, lazyMarker)
  return { delayed = jobPrefix .. 'delayed', wait = jobPrefix .. 'wait', meta = jobPrefix .. 'meta',
    active = jobPrefix .. 'active', marker = jobPrefix .. 'marker', events = jobPrefix .. 'events',
    jobPrefix = jobPrefix, lazyMarker = lazyMarker }
end

local function isQueuePausedOrMaxed(metaKey, activeKey)
  local attrs = rcall('HMGET', metaKey, 'paused', 'concurrency')
  if attrs[1] then return true end
  if attrs[2] then return rcall('LLEN', activeKey) >= tonumber(attrs[2]) end
  return false
end

-- A job that starts (or vanishes) can no longer absorb identical requests.
local function forgetCoalescing(coalesceKey, jobId)
  local entry = rcall('HGET', coalesceKey, 'job:' .. jobId)
  if entry then
    rcall('HDEL', coalesceKey, entry, 'job:' .. jobId)
  end
end

local function handOff(q, execKey, fenceKey, jobId, coalesceKey)
  forgetCoalescing(coalesceKey, jobId)
  local jobKey = q.jobPrefix .. jobId
  if rcall('ZREM', q.delayed, jobId) == 1 then
    local token = tostring(rcall('INCR', fenceKey))
    rcall('HSET', execKey, 'job', jobId, 'token', token)
    local waiting = rcall('LPUSH', q.wait, jobId)
    if not (q.lazyMarker and waiting == 1) and not isQueuePausedOrMaxed(q.meta, q.active) then
      rcall('ZADD', q.marker, 0, '0')
    end
    rcall('XADD', q.events, '*', 'event', 'waiting', 'jobId', jobId, 'prev', 'delayed')
    rcall('HSET', jobKey, 'delay', 0, 'progress', '{"lane":"handed-off","fence":"' .. token .. '"}')
    return 'promoted'
  end
  if rcall('EXISTS', jobKey) == 0 then
    return 'missing'
  end
  return 'elsewhere'
end

--[[
  After a lane's head was removed: hand off the next job, skipping jobs that were removed
  while they waited. Returns {'next', jobId, handOffResult} or {'idle'}.
]]
local function advanceLane(q, listKey, execKey, fenceKey, lanesKey, laneId, now)
  while true do
    local nextJob = rcall('LINDEX', listKey, 0)
    if not nextJob then
      rcall('ZREM', lanesKey, laneId)
      return {'idle'}
    end
    local r = handOff(q, execKey, fenceKey, nextJob, listKey .. ':c')
    if r ~= 'missing' then
      -- The lanes index is not touched on every hand-off: a busy lane only gets looked at
      -- by the sweep, which costs less than a write per operation.
      return {'next', nextJob, r}
    end
    rcall('LPOP', listKey)
    forgetCoalescing(listKey .. ':c', nextJob)
  end
end
