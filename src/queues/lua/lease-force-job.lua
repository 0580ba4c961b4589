--[[
  The job of a force-stop the watchdog claimed (lease-force-claim.lua) and queued in a lane
  other than the record's own (lane-push.lua keeps it as it joins the record's own), kept on the
  lease's record while the record still shows that claim (same episode, same count): the
  watchdog waits for that job to end before it considers another.

  KEYS[1] lease record hash
  ARGV[1] the episode's since (ms)   ARGV[2] the force-stop's number   ARGV[3] its job id

  Returns 1 when kept, 0 when the record moved on.
]]
local found = redis.call('HMGET', KEYS[1], 'since', 'forceStops')
if found[1] ~= ARGV[1] or found[2] ~= ARGV[2] then
  return 0
end
redis.call('HSET', KEYS[1], 'forceJob', ARGV[3])
return 1
