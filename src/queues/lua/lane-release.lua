--[[
  Ends the executing head of a lane and hands off the next job, in one atomic step.
  Refused for a stale attempt: one whose token is no longer the lane's current one.
  The outcome is kept on the job hash (see recordOutcome in includes/lane.lua).

  A failure is noted in the failures index (see noteFailure), which lists leases whose last
  operation failed; the lane's next success clears it.

  KEYS[1] lane list   KEYS[2] lane holder   KEYS[3] lane coalescing   KEYS[4] lanes index
  KEYS[5] fencing counter   KEYS[6] failures   KEYS[7] failures by time   KEYS[8] backing off
  KEYS[9] BullMQ delayed   KEYS[10] BullMQ wait   KEYS[11] BullMQ meta   KEYS[12] BullMQ active
  KEYS[13] BullMQ marker   KEYS[14] BullMQ events
  KEYS[15] counted lanes   KEYS[16] queued by company   KEYS[17] queued by environment
  KEYS[18] paused lanes
  (see includes/lane.lua)
  KEYS[19] the job's hash   KEYS[20] acquires not yet ended (an acquire leaves it here, in
  the same step, so the sweep never takes an acquire BullMQ removed on completion for one
  that vanished)
  ARGV[1] job id   ARGV[2] token   ARGV[3] outcome (JSON)   ARGV[4] lane id   ARGV[5] now
  ARGV[6] BullMQ job key prefix   ARGV[7] '1' when this worker's own fetch of its next job
  follows on this connection (see handOff)   ARGV[8] '1' when the outcome is a failure
  ARGV[9] how long failed jobs are kept (ms): older failure entries are trimmed
  ARGV[10] '1' when this is an acquire that completed: its entry in KEYS[20] then says so
  (with when) instead of going, so a clean-up queued for it by a crash or a stale attempt
  can tell, even once BullMQ removed the job (see OperationsQueue.acquireCompleted)
  KEYS[22] the attention scope index (see indexScope in includes/lane.lua)
  KEYS[21] the lease's history   ARGV[11] the end's history entry, its fields already joined
  (see lease-history.ts), or '' for none: written here, so an attempt's end costs no round
  trip of its own, and never for a stale attempt
  KEYS[23] bytes held, by company   KEYS[24] the company's counted jobs (company-bytes.ts)
  ARGV[12] the job's company: a counted job is counted ARGV[13] bytes and twice its outcome
  more (what its attempts left, and the result, which BullMQ keeps as its return value too)
  KEYS[25] the lease's record: the next job's progress carries what its start looks at there
  (see handOff)
  ARGV[14] for an acquire that completed with a sandbox whose id is the lease's own (nothing
  to name: the attempt noted no sandbox itself), that id: noted here, in the step that ends
  the acquire, as the lease's acquired sandbox (one lease, one sandbox: lease-records.ts),
  the record then kept ARGV[15] s (RECORD_TTL_S there)
  KEYS[26] the company's operations in their lanes, by deadline (lane-push.lua): the job leaves it

  An acquire that completed, but was cancelled (job-cancel.lua marked its job) while it ran,
  is not released: {'cancelled'}, and the attempt fails it instead, queueing the clean-up of
  its sandbox first. The mark and the release are each atomic, so a cancel that was answered
  as taken is always honoured, and one that came after the release finds the outcome there.

  Returns {'stale'} | {'cancelled'} | {'next', jobId, handOffResult} | {'idle'}
]]
local rcall = redis.call
--- @include "lane"
--- @include "history"
local k = laneKeys(KEYS)
local jobKey = KEYS[19]
local jobId, token, outcome, laneId, now = ARGV[1], ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5])

local holder = rcall('HMGET', k.holder, 'job', 'token')
if holder[1] ~= jobId or holder[2] ~= token then
  return {'stale'}
end
-- What recordOutcome and noteFailure read of the job, with the cancel mark, in one read.
local job = rcall('HMGET', jobKey, 'name', 'atm', 'lo:cancel')
if ARGV[10] == '1' and job[3] then
  return {'cancelled'}
end

-- The holder is always the head: only release, drop and repair remove a head, and force-
-- stops never go before an executing one.
-- Not in the backing-off index: a job leaves it in the step that makes it the holder (lane-
-- acquire, handOff), and one that backs off stops being the holder (lane-yield).
if ARGV[10] == '1' and ARGV[14] ~= '' then
  rcall('HSET', KEYS[25], 'acquiredSandbox', ARGV[14], 'acquiredBy', jobId)
  rcall('EXPIRE', KEYS[25], ARGV[15])
end
rcall('LPOP', k.list)
-- The holder goes below, unless the next job's hand-off names a new one in its place.
rcall('ZREM', KEYS[26], jobId)
forgetCoalescing(k, jobId)
if ARGV[10] == '1' then
  rcall('HSET', KEYS[20], jobId, 'completed ' .. ARGV[5])
else
  rcall('HDEL', KEYS[20], jobId)
end
local name = recordOutcome(jobKey, outcome, job)
if ARGV[12] ~= '' and rcall('HEXISTS', KEYS[24], jobId) == 1 then
  local ended = tonumber(ARGV[13]) + 2 * #outcome
  rcall('HINCRBY', KEYS[24], jobId, ended)
  rcall('HINCRBY', KEYS[23], ARGV[12], ended)
end
-- A cancel (an operator's, or a host that gave up) is no failure for anyone to attend to.
local cancelled = ARGV[8] == '1' and string.find(outcome, '"code":"cancelled"', 1, true) ~= nil
if not cancelled then
  noteFailure(k, laneId, jobId, now, ARGV[8] == '1', tonumber(ARGV[9]), name or '?', KEYS[22], jobKey)
end
if ARGV[11] ~= '' then
  historyAppendJoined(KEYS[21], ARGV[11])
end
local advanced = advanceLane(k, ARGV[6], laneId, ARGV[7] == '1', KEYS[25])
if advanced[3] ~= 'promoted' then
  rcall('DEL', k.holder)
end
return advanced
