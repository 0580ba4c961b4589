--[[
  Gives back a force-stop the watchdog claimed (lease-force-claim.lua) and could not queue (its
  lane was full, or Redis failed it): the record shows the count and job it showed before, so
  no view counts a force-stop that was never queued, and the next check claims it again.
  Only while the record still shows that claim with no job.

  KEYS[1] lease record hash
  ARGV[1] the episode's since (ms)   ARGV[2] the force-stop claimed   ARGV[3] the job before ('' for none)

  Returns 1 when given back, 0 when the record moved on.
]]
local rcall = redis.call
local found = rcall('HMGET', KEYS[1], 'since', 'forceStops', 'forceJob')
if found[1] ~= ARGV[1] or found[2] ~= ARGV[2] or found[3] then
  return 0
end
local before = tonumber(ARGV[2]) - 1
if before > 0 then
  rcall('HSET', KEYS[1], 'forceStops', before)
else
  rcall('HDEL', KEYS[1], 'forceStops')
end
if ARGV[3] ~= '' then
  rcall('HSET', KEYS[1], 'forceJob', ARGV[3])
end
return 1
