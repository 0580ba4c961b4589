--[[
  Takes a job that is not executing out of its lane, with the outcome the caller decided
  (a queued operation whose deadline passed while it waited, or one an operator cancelled).
  If it was the head, the next job is handed off.

  KEYS[1] lane list   KEYS[2] lane holder   KEYS[3] lane coalescing   KEYS[4] lanes index
  KEYS[5] fencing counter   KEYS[6] failures   KEYS[7] failures by time   KEYS[8] backing off
  KEYS[9] BullMQ delayed   KEYS[10] BullMQ wait   KEYS[11] BullMQ meta   KEYS[12] BullMQ active
  KEYS[13] BullMQ marker   KEYS[14] BullMQ events
  KEYS[15] counted lanes   KEYS[16] queued by company   KEYS[17] queued by environment
  KEYS[18] paused lanes
  (see includes/lane.lua)
  KEYS[19] the job's hash   KEYS[20] the job's BullMQ lock
  KEYS[21] the attention scope index (see indexScope in includes/lane.lua)
  KEYS[22] the company's operations in their lanes, by deadline (lane-push.lua): it leaves
  ARGV[1] job id   ARGV[2] lane id   ARGV[3] now (ms)   ARGV[4] BullMQ job key prefix
  ARGV[5] outcome (JSON)   ARGV[6] how long failed jobs are kept (ms)
  ARGV[7] '1' to refuse a job BullMQ still holds active (an operator's cancel): between the
  lane's yield before a retry and BullMQ's move to delayed the job is no longer the lane's
  holder, yet BullMQ is about to count the attempt, and an outcome recorded then would read
  as an operator's retry when the retry runs
  ARGV[8] the lock token of the attempt that drops its own job (parked past its deadline),
  or '' (an operator's cancel)

  Returns {'stale'} (refused: that attempt no longer holds the job's lock; its worker froze
  after its lane step, and another worker may have run the job to its end meanwhile),
  {'executing'} (refused: it runs), {'absent'} (not in the lane), or
  {'dropped', ...advance} where advance is {'next', jobId, r}, {'idle'} or {'waiting'}.
]]
local rcall = redis.call
--- @include "lane"
local k = laneKeys(KEYS)
local jobKey = KEYS[19]
local jobId, laneId, now = ARGV[1], ARGV[2], tonumber(ARGV[3])

if ARGV[8] ~= '' and rcall('GET', KEYS[20]) ~= ARGV[8] then
  return {'stale'}
end
local at = rcall('LPOS', k.list, jobId)
if not at then
  return {'absent'}
end
if at == 0 and rcall('HGET', k.holder, 'job') == jobId then
  return {'executing'}
end
if ARGV[7] == '1' and rcall('LPOS', k.active, jobId) then
  return {'executing'}
end
rcall('LREM', k.list, 1, jobId)
rcall('ZREM', KEYS[22], jobId)
recount(k, laneId)
forgetCoalescing(k, jobId)
rcall('HDEL', jobKey, 'lo:parked')
local name = recordOutcome(jobKey, ARGV[5])
rcall('ZREM', k.backingOff, jobId)
-- An operator's cancel is no failure for anyone to attend to.
if ARGV[7] ~= '1' then
  noteFailure(k, laneId, jobId, now, true, tonumber(ARGV[6]), name or '?', KEYS[21], jobKey)
end
if at == 0 then
  local advanced = advanceLane(k, ARGV[4], laneId, false)
  return {'dropped', advanced[1], advanced[2], advanced[3]}
end
return {'dropped', 'waiting'}
