--[[
  The watchdog claims the next force-stop of a stuck episode before it queues it: counted on
  the lease's record only while the record still shows what the watchdog decided on (the
  episode, its count, and the last force-stop's job, which the watchdog saw ended). A record
  that moved on meanwhile (that force-stop's end saw the sandbox stopped, a new episode) or
  another replica's claim refuses it, so the watchdog queues, notes and counts nothing.

  The claimed force-stop has no job on the record until it is queued (lease-force-job.lua):
  a watchdog that finds the count with no job finishes queueing that same force-stop (its
  idempotency key names the episode and the count), so a crash in between loses nothing.

  KEYS[1] lease record hash
  ARGV[1] the episode's since (ms)   ARGV[2] the force-stop claimed (1 for the first)
  ARGV[3] the last force-stop's job as the watchdog read it ('' for none)

  Returns 1 when claimed, 0 when refused.
]]
local rcall = redis.call
local found = rcall('HMGET', KEYS[1], 'since', 'forceStops', 'forceJob')
if found[1] ~= ARGV[1] then
  return 0
end
if tonumber(found[2] or '0') ~= tonumber(ARGV[2]) - 1 or (found[3] or '') ~= ARGV[3] then
  return 0
end
rcall('HSET', KEYS[1], 'forceStops', ARGV[2])
rcall('HDEL', KEYS[1], 'forceJob')
return 1
