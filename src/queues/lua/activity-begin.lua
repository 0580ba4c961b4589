--[[
  Begins an activity on a lease (work inside its sandbox) unless the lease is closing: a stop,
  force-stop, destroy or release (other than keep_running) of it queued or running. Such an
  operation waits for the lease's open activities to end (activity-gate.lua), so one begun
  now would outlive the stop that was asked for.

  KEYS[1] the lane's list   KEYS[2] the lease's activities
  ARGV[1] BullMQ job key prefix   ARGV[2] the new token   ARGV[3] kind   ARGV[4] ttl (ms)
  ARGV[5] the lease identity (JSON)
  Job hashes are derived from the ids in the lane, as the lane scripts derive them.

  Returns {'begun', expiresAt} or {'closing', jobId, op}.
]]
local rcall = redis.call
--- @include "activities"
local jobPrefix = ARGV[1]
local closing = {stop = true, ['force-stop'] = true, destroy = true}
local jobs = rcall('LRANGE', KEYS[1], 0, -1)
for i = 1, #jobs do
  local job = rcall('HMGET', jobPrefix .. jobs[i], 'name', 'data')
  local name = job[1]
  if closing[name] then
    return {'closing', jobs[i], name}
  end
  if name == 'release' then
    local ok, data = pcall(cjson.decode, job[2] or '')
    local disposition = ok and type(data) == 'table' and type(data.params) == 'table' and data.params.resourceDisposition
    if disposition ~= 'keep_running' then
      return {'closing', jobs[i], name}
    end
  end
end
local now = redisNow()
openActivities(KEYS[2], now)
local expiresAt = now + tonumber(ARGV[4])
rcall('HSET', KEYS[2], ARGV[2], cjson.encode({kind = ARGV[3], since = now, expiresAt = expiresAt, cancel = false, lease = ARGV[5]}))
keepFor(KEYS[2], expiresAt)
return {'begun', tostring(expiresAt)}
