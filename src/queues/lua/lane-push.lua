--[[
  Appends an accepted operation to its lease's lane and, if it is the head with nothing
  executing, hands it to the workers. A force-stop ('front') goes ahead of queued and
  backing-off operations, never alongside an executing one.

  KEYS[1] lane list   KEYS[2] lane holder   KEYS[3] lane coalescing   KEYS[4] lanes index
  KEYS[5] fencing counter   KEYS[6] failures   KEYS[7] failures by time   KEYS[8] backing off
  KEYS[9] BullMQ delayed   KEYS[10] BullMQ wait   KEYS[11] BullMQ meta   KEYS[12] BullMQ active
  KEYS[13] BullMQ marker   KEYS[14] BullMQ events
  KEYS[15] counted lanes   KEYS[16] queued by company   KEYS[17] queued by environment
  KEYS[18] paused lanes
  (see includes/lane.lua)
  KEYS[19] the job's hash   KEYS[20] the request's idempotency key (a placeholder when it has none)
  KEYS[21] the lease's history (see includes/history.lua)
  KEYS[22] the partition's copy of the deployment's partition count (see layout.ts)
  KEYS[23] the lane's alias key: set when this lane's id is a sandbox's and that sandbox is a
  second name of its acquire's lane (lane-alias.lua)
  KEYS[24] the company's reruns on their way to their lanes (rerun-admit.lua): counted with
  the operations of the lane, the environment and the company they will join
  KEYS[26] the company's operations in their lanes, by deadline: the job joins it, scored by
  ARGV[21] (an adopted job: by the deadline its stored data holds); its release or drop takes
  it out (the sweep, an entry whose job went otherwise: Lanes.tidyDeadlines)
  KEYS[25] the lease's record (lease-records.ts), for a watchdog's force-stop (a placeholder
  otherwise): see ARGV[23]
  ARGV[1] job id   ARGV[2] lane id   ARGV[3] now (ms)   ARGV[4] 'tail' | 'front'
  ARGV[5] BullMQ job key prefix
  ARGV[6] coalescing key ('' for none): an identical request queued last and not yet
          started (handed to the workers, perhaps, but taken by none) absorbs this one
  ARGV[7] most operations a lane may hold (0: no limit; force-stops are never refused)
  ARGV[8] most operations the queue may hold waiting, parked or backing off, this one
          included (it is already parked when this runs); 0: no limit
  ARGV[9] '1' when the job was stored by an earlier request with the same idempotency key
          (a retry finishing an enqueue cut short)
  ARGV[10] the request's fingerprint (kept with its idempotency key)   ARGV[11] '1' when
  the request has an idempotency key (KEYS[20] is then that key)
  ARGV[12] the lease's company   ARGV[13] its environment
  ARGV[14] most operations a company's lanes may hold   ARGV[15] most an environment's may
  hold (0: no limit; force-stops have room of their own above each)
  ARGV[16] the partition count the caller maps leases with: refused ({'layout', held})
  when the partition holds another, so a process that missed a change of the count never
  puts a lease's operation in a partition other than the one its lane is in
  ARGV[17] how long a sandbox's name of its lane is kept after its last use (ms)
  ARGV[18] ARGV[19] an event to write before `accepted` ('' for none): its kind, its fields
  ARGV[20] when the operation was accepted (its data's acceptedAt, ms): the `accepted`
  event's time, so the timeline and the operation's view say one time
  ARGV[23] ARGV[24] a watchdog's force-stop: the stuck episode's `since` and the force-stop's
  number it claimed on the lease's record (lease-force-claim.lua); '' for any other job. It
  joins only while the record still shows that claim ({'claim-over'} otherwise, and nothing
  of it joins), and the record keeps its job in the step it joins
  ARGV[25] this call's own mark (random): kept on the job as it joins (or is absorbed), so the
  same call sent again (its client lost the reply and resent it) answers as its first run did
  ({'joined'}, or {'absorbed', by}) instead of joining the job a second time, absorbing it into
  itself, or noting the absorption twice
  ARGV[22] '1' for a failed job an operator runs again (BullMQ's retry just moved it back to
  wait): it joins now, at its lane's tail (a force-stop at the front) like a new request,
  its recorded outcome forgotten and its place among the company's reruns on their way
  (KEYS[24]) given up; {'present'} when a worker took it first (lane-acquire.lua joined it)
  ARGV[21] its deadline (ms; '' for none, then also ARGV[20]): a queued identical request
  absorbs it only if the two deadlines are at most a tenth of this one's time (5 s at most)
  apart: its caller must neither lose time it asked for nor wait past its deadline
  A job already in its lane, or one with an outcome, is left alone when either of ARGV[9] and
  ARGV[11] is set: two requests with one key may both get here (a retry while the first was
  slow), and the job must join its lane once.

  Returns {'queued'} when it waits behind others, {'next', jobId, handOffResult} when it was
  handed to the workers, {'removed'} (its job was removed before it joined its lane),
  {'absorbed', existingJobId} or {'full', 'lease' | 'environment' | 'company' | 'queue', count}
  (in both cases the caller drops its own job), {'present'} (already accepted), or {'gone'}
  (its idempotency key no longer names it as pending: another request took it back), or
  {'alias', laneId} (the lease is a second name of that lane: nothing was done here; the
  caller drops its job and enqueues into that lane), or {'claim-over'} (ARGV[23]).
]]
local rcall = redis.call
--- @include "lane"
--- @include "history"
local k = laneKeys(KEYS)
local jobKey, idemKey = KEYS[19], KEYS[20]
local jobId, laneId, now, mode, jobPrefix = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]

-- The job's operation is read here too, for the events below (nothing here changes it).
local pushedBefore = rcall('HMGET', jobKey, 'lo:push', 'lo:absorbed', 'name')
local opName = pushedBefore[3] or ''
if pushedBefore[1] == ARGV[25] then
  if pushedBefore[2] then
    return {'absorbed', pushedBefore[2]}
  end
  return {'joined'}
end

local layout = rcall('GET', KEYS[22])
if layout and layout ~= ARGV[16] then
  return {'layout', layout}
end

local alias = rcall('GET', KEYS[23])
if alias and alias ~= laneId then
  rcall('PEXPIRE', KEYS[23], ARGV[17])
  return {'alias', alias}
end

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
if ARGV[22] == '1' then
  rcall('ZREM', KEYS[24], ARGV[13] .. '\n' .. jobId)
  -- A worker took it first: it joined its lane then (lane-acquire.lua), and may even have
  -- run and ended since (it left the lane again): either way nothing is left to join.
  if rcall('LPOS', k.list, jobId) or rcall('HEXISTS', jobKey, 'finishedOn') == 1 or rcall('LPOS', k.active, jobId) then
    return {'present'}
  end
  rcall('HDEL', jobKey, 'lo:outcome', 'lo:released-atm', 'lo:front')
end

-- With a key, the job joins only while the key still names it as pending: a refused request
-- with the same key takes the key back before its job (operations-queue.ts, joinLane).
if ARGV[11] == '1' then
  local ok, held = pcall(cjson.decode, rcall('GET', idemKey) or '')
  if not (ok and type(held) == 'table' and held.jobId == jobId and held.state == 'pending') then
    return {'gone'}
  end
end

-- Removed (an operator, Bull Board) after it was stored and before it got here: it never joins
-- its lane, which would otherwise name a job that does not exist and wait on it. Answered as
-- accepted and then removed, as a removal a moment later would be.
if rcall('EXISTS', jobKey) == 0 then
  accepted(jobId)
  historyAppend(KEYS[21], {'e', 'removed', 'job', jobId, 'message', 'removed before it joined its lane'})
  return {'removed'}
end

-- A watchdog's force-stop claimed for an episode the record no longer shows (its sandbox was
-- seen stopped, or left stopping and came back, while the watchdog was between its claim and
-- here): it is not queued, so it neither forces a later episode early nor notes one.
if ARGV[23] ~= '' then
  local record = rcall('HMGET', KEYS[25], 'since', 'forceStops')
  if record[1] ~= ARGV[23] or record[2] ~= ARGV[24] then
    return {'claim-over'}
  end
end

-- Heads removed through BullMQ's own API go first: this operation must not wait behind them
-- (one backing off would hold the lane till its retry time, when the sweep looks again).
local dropped = dropRemovedHeads(k, jobPrefix, laneId, now)
-- Every answer but this job's own hand-off first hands off a parked head the drop exposed.
local function answer(reply)
  if dropped then
    handOffExposed(k, jobPrefix, laneId)
  end
  return reply
end

local coalesceAs = ARGV[6]
if coalesceAs ~= '' then
  -- Only the last queued request can absorb: one with other requests after it would
  -- change what the lease ends up in (stop, resume, stop is not stop, resume).
  local existing = rcall('HGET', k.coalesce, coalesceAs)
  if existing and (rcall('EXISTS', jobPrefix .. existing) == 0 or rcall('HEXISTS', jobPrefix .. existing, 'processedOn') == 1) then
    -- Removed through BullMQ's own API (it will never run), or started: it absorbs nothing.
    forgetCoalescing(k, existing)
    existing = nil
  end
  if existing and rcall('LINDEX', k.list, -1) ~= existing then
    existing = nil
  end
  if existing and ARGV[21] ~= '' then
    local deadline = tonumber(ARGV[21])
    local slack = math.min(5000, math.floor((deadline - tonumber(ARGV[20])) / 10))
    local ok, held = pcall(cjson.decode, rcall('HGET', jobPrefix .. existing, 'data') or '')
    if not ok or type(held) ~= 'table' or not tonumber(held.deadlineAt) or math.abs(tonumber(held.deadlineAt) - deadline) > slack then
      existing = nil
    end
  end
  if existing then
    accepted(existing)
    -- Kept on this job (which its caller removes next) for this call sent again meanwhile.
    rcall('HSET', jobKey, 'lo:push', ARGV[25], 'lo:absorbed', existing)
    historyAppend(KEYS[21], {'e', 'absorbed', 'job', existing, 'op', opName})
    return answer({'absorbed', existing})
  end
end

-- Limits, checked in the same atomic step that would grow the lane and the queue. The
-- company's reruns on their way (few, and none most of the time) count where they will join.
local company, environment = ARGV[12], ARGV[13]
local rerunsOfLane, rerunsOfEnvironment = 0, 0
local reruns = rcall('ZCARD', KEYS[24])
if reruns > 0 then
  for _, member in ipairs(rcall('ZRANGE', KEYS[24], 0, -1)) do
    local nl = string.find(member, '\n', 1, true)
    if string.sub(member, nl + 1, nl + #laneId) == laneId then rerunsOfLane = rerunsOfLane + 1 end
    if string.sub(member, 1, nl - 1) == environment then rerunsOfEnvironment = rerunsOfEnvironment + 1 end
  end
end
local maxPerLane, maxQueued = tonumber(ARGV[7]), tonumber(ARGV[8])
if maxPerLane > 0 and mode ~= 'front' then
  local inLane = rcall('LLEN', k.list) + rerunsOfLane
  if inLane >= maxPerLane then
    return answer({'full', 'lease', inLane})
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
    return answer({'full', 'lease', fronts})
  end
end
-- Room of their own above a limit for force-stops (a tenth of it, at least 100), so a backlog
-- of other operations never keeps one out; past that room they are refused too.
local front = mode == 'front'
local function withRoom(limit)
  return limit + math.max(100, math.floor(limit / 10))
end
local byCompany = tonumber(rcall('HGET', k.byCompany, company) or '0') + reruns
local maxPerCompany, maxPerEnvironment = tonumber(ARGV[14]), tonumber(ARGV[15])
if maxPerEnvironment > 0 then
  local held = tonumber(rcall('HGET', k.byEnvironment, company .. '\n' .. environment) or '0') + rerunsOfEnvironment
  if held >= (front and withRoom(maxPerEnvironment) or maxPerEnvironment) then
    return answer({'full', 'environment', held})
  end
end
if maxPerCompany > 0 and byCompany >= (front and withRoom(maxPerCompany) or maxPerCompany) then
  return answer({'full', 'company', byCompany})
end
if maxQueued > 0 then
  -- Past the queue's limit, a company holding less than its fair share (the limit over the
  -- companies with work queued) still gets in: one company's backlog, force-stops included,
  -- never refuses another's operations (their own limits bound them). A company holding its
  -- share is refused, but for force-stops, which have a room above the limit (a tenth of it,
  -- at least 100) before they are refused too.
  local queued = rcall('ZCARD', k.delayed) + rcall('LLEN', k.wait)
  if queued > maxQueued then
    local companies = rcall('HLEN', k.byCompany) + (byCompany == 0 and 1 or 0)
    local overShare = byCompany >= math.floor(maxQueued / companies)
    if overShare and (not front or queued > withRoom(maxQueued)) then
      return answer({'full', 'queue', queued - 1})
    end
  end
end

if coalesceAs ~= '' then
  rcall('HSET', k.coalesce, coalesceAs, jobId, 'job:' .. jobId, coalesceAs)
end
rcall('ZADD', k.lanes, 'NX', now, laneId)
accepted(jobId)
rcall('HSET', jobKey, 'lo:push', ARGV[25])
if ARGV[23] ~= '' then
  rcall('HSET', KEYS[25], 'forceJob', jobId)
end

local waits
if mode == 'front' then
  waits = queueFront(k, jobPrefix, jobId)
else
  waits = rcall('RPUSH', k.list, jobId) > 1
end
-- Scored by the stored job's deadline: an adopted job (stored by an earlier request cut
-- short) keeps the deadline it was stored with, whatever this request asked (helper-33).
local deadline = ARGV[21]
if ARGV[9] == '1' then
  local ok, stored = pcall(cjson.decode, rcall('HGET', jobKey, 'data') or '')
  local at = ok and type(stored) == 'table' and stored.deadlineAt
  -- A number as JSON writes one (not NaN or infinite, which ZADD refuses after the push began).
  if type(at) == 'number' and at == at and at > -math.huge and at < math.huge then
    deadline = at
  end
end
if deadline ~= '' then
  rcall('ZADD', KEYS[26], deadline, jobId)
end
recount(k, laneId, company, environment)
if ARGV[18] ~= '' then
  historyAppendJoined(KEYS[21], 'e\31' .. ARGV[18] .. '\31job\31' .. jobId .. (ARGV[19] ~= '' and ('\31' .. ARGV[19]) or ''))
end
local acceptance = {'e', 'accepted', 'job', jobId, 'op', opName, 'ahead', rcall('LPOS', k.list, jobId) or 0}
if ARGV[20] ~= '' then
  acceptance[#acceptance + 1] = 'at'
  acceptance[#acceptance + 1] = ARGV[20]
end
historyAppend(KEYS[21], acceptance)
if waits then
  rcall('HSET', jobKey, 'lo:parked', '1')
  return answer({'queued'})
end
-- It is the head now: if it went ahead of a head backing off, the lane's progress (dated
-- when that retry comes due) is now.
if mode == 'front' then
  rcall('ZADD', k.lanes, 'XX', now, laneId)
end
return {'next', jobId, handOff(k, jobPrefix, jobId, false, laneId)}
