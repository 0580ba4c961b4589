--[[
  Steps shared by the lane scripts (included where a script says `--- @include "lane"`).
  Every lane script takes the same keys, in this order, all under one hash tag:
    KEYS[1]  lane list             job ids of one lease, head first
    KEYS[2]  lane holder hash      {job, token} of the executing head
    KEYS[3]  lane coalescing hash  coalescing key -> queued job id, and 'job:'..id -> key
    KEYS[4]  lanes index           zset lane id -> last progress (ms)
    KEYS[5]  fencing counter       behind every fencing token
    KEYS[6]  failures              hash lane id -> '<ms> <job id>' of its last operation, failed
    KEYS[7]  failures by time      zset lane id -> that ms (newest first for attention; trimmed)
    KEYS[8]  backing off           zset job id -> when its retry comes due (ms)
    KEYS[9]  BullMQ delayed        zset job id -> due time * 4096 (+ a tie counter)
    KEYS[10] BullMQ wait           list of job ids ready to run
    KEYS[11] BullMQ meta           hash: paused, concurrency
    KEYS[12] BullMQ active         list of running job ids
    KEYS[13] BullMQ marker         zset whose members wake idle workers
    KEYS[14] BullMQ events         stream
    KEYS[15] counted lanes         hash lane id -> '<n>\n<company>\n<environment>': what the
                                   two counts below hold for this lane (see recount)
    KEYS[16] queued by company     hash company -> operations in its lanes
    KEYS[17] queued by environment hash '<company>\n<environment>' -> operations in its lanes
    KEYS[18] paused lanes          hash laneId -> who paused it and when (JSON): nothing starts there
  Job hashes (`<queue key prefix><job id>`) are derived from the ids in the lane, as
  BullMQ's own scripts derive them. What each BullMQ key and field means to BullMQ is pinned
  by test/bullmq-contract.test.ts.
]]
local function laneKeys(keys)
  return { list = keys[1], holder = keys[2], coalesce = keys[3], lanes = keys[4], fence = keys[5], failures = keys[6],
    failuresAt = keys[7], backingOff = keys[8], delayed = keys[9], wait = keys[10], meta = keys[11], active = keys[12],
    marker = keys[13], events = keys[14], counted = keys[15], byCompany = keys[16], byEnvironment = keys[17],
    paused = keys[18] }
end

--[[
  Brings the company and environment counts in line with the lane's length, after anything
  that may have changed it: each lane remembers what it added to them, so a count is the sum
  of its lanes' lengths however a job left (ended, dropped, removed by an operator). Ids
  cannot hold control characters, so '\n' separates them unambiguously. A lane with no record
  is counted from the next call that names its scope (company, environment).
]]
local function recount(k, laneId, company, environment)
  local n = rcall('LLEN', k.list)
  local record = rcall('HGET', k.counted, laneId)
  local was = 0
  if record then
    local i = string.find(record, '\n', 1, true)
    local j = string.find(record, '\n', i + 1, true)
    was = tonumber(string.sub(record, 1, i - 1))
    company, environment = string.sub(record, i + 1, j - 1), string.sub(record, j + 1)
  end
  if not company or n == was then
    return
  end
  local scope = company .. '\n' .. environment
  if rcall('HINCRBY', k.byCompany, company, n - was) <= 0 then
    rcall('HDEL', k.byCompany, company)
  end
  if rcall('HINCRBY', k.byEnvironment, scope, n - was) <= 0 then
    rcall('HDEL', k.byEnvironment, scope)
  end
  if n == 0 then
    rcall('HDEL', k.counted, laneId)
  else
    rcall('HSET', k.counted, laneId, n .. '\n' .. scope)
  end
end

local function isQueuePausedOrMaxed(k)
  local attrs = rcall('HMGET', k.meta, 'paused', 'concurrency')
  if attrs[1] then return true end
  if attrs[2] then return rcall('LLEN', k.active) >= tonumber(attrs[2]) end
  return false
end

-- A job that leaves the lane can no longer absorb identical requests; nor can one that has
-- started, which lane-push and lane-upgrade tell by its processedOn (set when BullMQ hands it
-- to a worker): a head handed off but not yet taken still absorbs.
local function forgetCoalescing(k, jobId)
  local entry = rcall('HGET', k.coalesce, 'job:' .. jobId)
  if entry then
    rcall('HDEL', k.coalesce, entry, 'job:' .. jobId)
  end
end

-- Takes a head that will never run (gone, or finished without the lane hearing of it) out of its lane.
local function dropHead(k, head)
  rcall('LPOP', k.list)
  rcall('ZREM', k.backingOff, head)
  forgetCoalescing(k, head)
  if rcall('HGET', k.holder, 'job') == head then
    rcall('DEL', k.holder)
  end
end

--[[
  Drops the lane's leading jobs that no longer exist: removed through BullMQ's own API
  (queue.remove, a clean), which tells lease-ops nothing. BullMQ refuses to remove a job
  while its lock is held, so none of them runs with its lock: an attempt that lost it (its
  worker froze) is refused at the fence. After a drop the lane's progress is now (a removed
  head's retry date no longer holds it back from the sweep) and its counts follow its new
  length, before any limit is checked against them. Returns true when it dropped any; the
  caller hands off the head this exposes (handOffExposed), if it should run now.
]]
local function dropRemovedHeads(k, jobPrefix, laneId, now)
  local dropped = false
  local head = rcall('LINDEX', k.list, 0)
  while head and rcall('EXISTS', jobPrefix .. head) == 0 do
    dropHead(k, head)
    dropped = true
    head = rcall('LINDEX', k.list, 0)
  end
  if dropped then
    rcall('ZADD', k.lanes, 'XX', now, laneId)
    recount(k, laneId)
  end
  return dropped
end

--[[
  Hands a lane's new head to the workers, in the same atomic step that made it the head:
  moves it from BullMQ's delayed set to the wait list exactly as BullMQ's promote does (wait
  list, marker, event, delay field), names it the lane's holder with a fresh fencing token,
  and leaves that token in the job's progress, so the worker that starts this first attempt
  can run it without asking the lane again.

  With lazyMarker (a release that this worker's own fetch of its next job follows on the
  same connection) the marker that wakes idle workers is left out when this job is the only
  one waiting: that fetch takes it, and waking another worker would only make it race.
  Returns 'promoted', 'missing' (the job was removed), 'elsewhere' (not parked: already
  waiting, or active while it parks; it then asks the lane itself), or 'held' (the lane is
  paused: nothing is handed off until it is unpaused).

  With recordKey (the lease's record), the progress also carries what the start of an
  operation looks at in the record (its sandbox, the acquired one, its kind, whether it is
  there), so that first attempt starts without reading it. Only the lane's holder writes
  those fields (lease-observe.lua and lease-acquired.lua are fenced; a release writes them
  before it hands off), and this job is the holder from here on, so they stay as copied
  until it writes them itself. Only a release passes it; any other hand-off leaves the attempt to read.
]]
local function handOffProgress(token, recordKey)
  if not recordKey then
    return '{"lane":"handed-off","fence":"' .. token .. '"}'
  end
  local r = rcall('HMGET', recordKey, 'providerLeaseId', 'acquiredSandbox', 'kind', 'lease')
  return cjson.encode({ lane = 'handed-off', fence = token,
    record = { sandbox = r[1] or '', acquired = r[2] or '', kind = r[3] or '', present = r[4] and r[3] and true or false } })
end

local function handOff(k, jobPrefix, jobId, lazyMarker, laneId, recordKey)
  -- An operator paused the lane: the head stays parked until the lane is unpaused.
  if rcall('HEXISTS', k.paused, laneId) == 1 then
    return 'held'
  end
  local jobKey = jobPrefix .. jobId
  if rcall('ZREM', k.delayed, jobId) == 1 then
    -- Handed off early (a force-stop ahead of it ended): no longer backing off.
    rcall('ZREM', k.backingOff, jobId)
    local token = tostring(rcall('INCR', k.fence))
    rcall('HSET', k.holder, 'job', jobId, 'token', token)
    local waiting = rcall('LPUSH', k.wait, jobId)
    if not (lazyMarker and waiting == 1) and not isQueuePausedOrMaxed(k) then
      rcall('ZADD', k.marker, 0, '0')
    end
    rcall('XADD', k.events, '*', 'event', 'waiting', 'jobId', jobId, 'prev', 'delayed')
    rcall('HSET', jobKey, 'delay', 0, 'progress', handOffProgress(token, recordKey))
    rcall('HDEL', jobKey, 'lo:parked')
    return 'promoted'
  end
  if rcall('EXISTS', jobKey) == 0 then
    return 'missing'
  end
  return 'elsewhere'
end

-- A parked head that a drop exposed, with nothing holding the lane: its turn is now.
local function handOffExposed(k, jobPrefix, laneId)
  local head = rcall('LINDEX', k.list, 0)
  if head and rcall('HEXISTS', k.holder, 'job') == 0 and rcall('HEXISTS', jobPrefix .. head, 'lo:parked') == 1 then
    handOff(k, jobPrefix, head, false, laneId)
  end
end

--[[
  After a lane's head was removed: hand off the next job, skipping jobs that were removed
  while they waited. Returns {'next', jobId, handOffResult} or {'idle'}.
]]
local function advanceLane(k, jobPrefix, laneId, lazyMarker, recordKey)
  while true do
    local nextJob = rcall('LINDEX', k.list, 0)
    if not nextJob then
      rcall('ZREM', k.lanes, laneId)
      recount(k, laneId)
      return {'idle'}
    end
    local r = handOff(k, jobPrefix, nextJob, lazyMarker, laneId, recordKey)
    if r ~= 'missing' then
      -- The lanes index is not touched on every hand-off: a busy lane only gets looked at
      -- by the sweep, which costs less than a write per operation.
      recount(k, laneId)
      return {'next', nextJob, r}
    end
    -- Removed while it waited, perhaps backing off: it leaves the backing-off index too.
    dropHead(k, nextJob)
  end
end

--[[
  The sanctioned exception: a force-stop goes ahead of queued and backing-off operations,
  never alongside an executing one, and force-stops keep the order they came in among
  themselves. A job that went to the front is marked (lo:front on its hash), so a lane reads
  as: [the executing head, if it is not a front job] [front jobs, in the order they came]
  [the others, in the order they came]. A new front job goes after the front jobs already
  there (a removed job among them counts as one: it is dropped when the lane reaches it).
  Returns true when it waits behind others, false when it became the head.
]]
local function frontBlockEnd(k, jobPrefix, from)
  local items = rcall('LRANGE', k.list, from, -1)
  local last = nil
  for i = 1, #items do
    local key = jobPrefix .. items[i]
    if rcall('HEXISTS', key, 'lo:front') == 1 or rcall('EXISTS', key) == 0 then
      last = items[i]
    else
      break
    end
  end
  return last
end

local function queueFront(k, jobPrefix, jobId)
  rcall('HSET', jobPrefix .. jobId, 'lo:front', '1')
  local head = rcall('LINDEX', k.list, 0)
  if not head then
    rcall('LPUSH', k.list, jobId)
    return false
  end
  local from = 0
  if rcall('HEXISTS', k.holder, 'job') == 1 and rcall('HEXISTS', jobPrefix .. head, 'lo:front') == 0 then
    from = 1
  end
  local after = frontBlockEnd(k, jobPrefix, from)
  if not after and from == 1 then
    after = head
  end
  if after then
    rcall('LINSERT', k.list, 'AFTER', after, jobId)
    return true
  end
  rcall('LPUSH', k.list, jobId)
  return false
end

-- Notes what failed in a lane, per kind of operation, until the lease's next operation of
-- that kind succeeds or an operator acknowledges it: a failed acquire stays although its
-- clean-up completes, a failed resume although a force-stop succeeds. The entry is JSON
-- {"<op>": {"at": ms, "job": jobId}, ...}; its index score is the newest failure's time.
-- An older entry '<ms> <jobId>' (from before kinds were kept) reads as one of kind '?'.
-- Entries older than BullMQ keeps failed jobs are trimmed: the index never outgrows attention.
local function failureKinds(k, laneId)
  local text = rcall('HGET', k.failures, laneId)
  if not text then return {} end
  local ok, kinds = pcall(cjson.decode, text)
  if ok and type(kinds) == 'table' then return kinds end
  local at, job = string.match(text, '^(%d+) (.+)$')
  if at then return { ['?'] = { at = tonumber(at), job = job } } end
  return {}
end

-- The attention scope index: one sorted set of '<company>\n<environment>\n<laneId>' (all at
-- score 0, so read by lex range per company or environment): a lane that may need attention
-- (a failure, a pause, a sandbox stopping) is put there as it begins to, so a company's
-- attention is read from its own entries. Entries whose reason ended are taken out by the
-- reads that find them so (inspect.ts); none is needed for correctness, only for cost.
local function indexScope(scopeKey, jobKey, laneId)
  if not scopeKey then return end
  local ok, data = pcall(cjson.decode, rcall('HGET', jobKey, 'data') or '')
  if ok and type(data) == 'table' and type(data.lease) == 'table' and type(data.lease.companyId) == 'string' and type(data.lease.environmentId) == 'string' then
    rcall('ZADD', scopeKey, 0, data.lease.companyId .. '\n' .. data.lease.environmentId .. '\n' .. laneId)
  end
end

local function noteFailure(k, laneId, jobId, now, failed, keepMs, op, scopeKey, jobKey)
  local kinds = failureKinds(k, laneId)
  if failed then
    indexScope(scopeKey, jobKey, laneId)
    kinds[op] = { at = now, job = jobId }
    rcall('HSET', k.failures, laneId, cjson.encode(kinds))
    rcall('ZADD', k.failuresAt, now, laneId)
    local old = rcall('ZRANGEBYSCORE', k.failuresAt, '-inf', now - keepMs, 'LIMIT', 0, 100)
    for i = 1, #old do
      rcall('HDEL', k.failures, old[i])
      rcall('ZREM', k.failuresAt, old[i])
    end
  elseif kinds[op] ~= nil then
    kinds[op] = nil
    if next(kinds) == nil then
      -- The two are written together, here only: a lane missing from one is in neither.
      rcall('HDEL', k.failures, laneId)
      rcall('ZREM', k.failuresAt, laneId)
    else
      rcall('HSET', k.failures, laneId, cjson.encode(kinds))
    end
  end
end

-- Keeps the outcome on the job hash, with BullMQ's attempts count as it was: a later run of
-- this job repeats the outcome while that count is unchanged (BullMQ never finished the job:
-- a crash came first), and runs again once BullMQ finished it and an operator retried it.
-- `job` is the job hash's {name, atm} when the caller read them already. Returns the name.
local function recordOutcome(jobKey, outcome, job)
  job = job or rcall('HMGET', jobKey, 'name', 'atm')
  -- Every BullMQ job hash has a name: without one the job was removed, and nothing is written.
  if job[1] then
    rcall('HSET', jobKey, 'lo:outcome', outcome, 'lo:released-atm', job[2] or '0')
  end
  return job[1]
end
