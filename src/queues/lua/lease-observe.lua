--[[
  Records what an operation saw of its sandbox: the state, and since when it has been in
  it (kept while the state stays the same). Leases seen on their way to stopped (Daytona's
  `stopping`, CreateOS' `pausing`) are indexed by since, so the stuck-stop watchdog and the
  attention list find them without listing the cloud. The record expires
  after `ttl` seconds without news, so idle leases leave nothing behind for good.

  Times are Redis' clock (TIME), not the caller's: replicas whose clocks differ still agree
  on how long a sandbox has been stopping.

  KEYS[1] lease record hash   KEYS[2] stopping index (zset laneId -> since ms)
  KEYS[3] the lease's history (a change of state is an event there)
  KEYS[4] the attention scope index (see indexScope in includes/lane.lua)
  ARGV[1] lane id   ARGV[2] state kind   ARGV[3] provider state
  ARGV[4] lease identity (JSON)   ARGV[5] provider lease id   ARGV[6] ttl (s)
  ARGV[7] '1' when the state is a transition toward stopped
  ARGV[8] the job whose attempt saw it ('' when none)
  ARGV[9] the lane's entry in the scope index ('<company>\n<environment>\n<laneId>')
  KEYS[5] the lane's holder   ARGV[10] the attempt's fencing token, or '' (not an attempt's)
  ARGV[11] '1' when the operation was accepted for the company's provider instance (its
  data's `instance`): the watchdog's force-stops go to that instance too

  Fenced: an attempt that lost its turn (frozen past its lock, say) records nothing, so what
  it saw long ago never overwrites what the lane's holder saw since.

  Returns {since, now} in ms: the `since` of the recorded state, and Redis' time; or
  {'stale'} for an attempt that no longer holds the lane.
]]
local rcall = redis.call
--- @include "history"
if ARGV[10] ~= '' and rcall('HGET', KEYS[5], 'token') ~= ARGV[10] then
  return {'stale'}
end
local recordKey, stoppingKey = KEYS[1], KEYS[2]
local laneId, kind, providerState = ARGV[1], ARGV[2], ARGV[3]
local time = rcall('TIME')
local now = tostring(tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000))

local previous = rcall('HMGET', recordKey, 'kind', 'providerState', 'since')
local since = now
if previous[1] == kind and previous[2] == providerState and previous[3] then
  since = previous[3]
else
  -- A new state is a new episode: the watchdog's force-stops start again.
  rcall('HDEL', recordKey, 'forceStops', 'forceJob')
  historyAppend(KEYS[3], {'e', 'observed', 'state', kind, 'providerState', providerState, 'sandbox', ARGV[5], 'job', ARGV[8]})
end
rcall('HSET', recordKey, 'kind', kind, 'providerState', providerState, 'since', since, 'observedAt', now,
  'lease', ARGV[4], 'providerLeaseId', ARGV[5])
-- The lease's acquired sandbox, seen gone, is the lease's no more: a later acquire's sandbox
-- with the same id (a provider that names sandboxes after their lease) is that acquire's own.
if kind == 'gone' and rcall('HGET', recordKey, 'acquiredSandbox') == ARGV[5] then
  rcall('HDEL', recordKey, 'acquiredSandbox', 'acquiredBy')
end
if ARGV[11] == '1' then rcall('HSET', recordKey, 'instance', '1') else rcall('HDEL', recordKey, 'instance') end
rcall('EXPIRE', recordKey, ARGV[6])

if ARGV[7] == '1' then
  rcall('ZADD', stoppingKey, since, laneId)
  rcall('ZADD', KEYS[4], 0, ARGV[9])
else
  rcall('ZREM', stoppingKey, laneId)
end
return {since, now}
