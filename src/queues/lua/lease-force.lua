--[[
  The watchdog queued a force-stop for a stuck episode: counts it on the lease's record,
  only while the record still shows that episode (a sandbox that moved on starts anew).

  KEYS[1] lease record hash
  ARGV[1] the episode's since (ms)   ARGV[2] force-stops queued for it so far   ARGV[3] job id

  Returns 1 when counted, 0 when the episode is over or this force-stop was counted already
  (a scan and the episode's own check can both queue the same one: its idempotency key
  makes it one job, and this makes it one count).
]]
if redis.call('HGET', KEYS[1], 'since') ~= ARGV[1] then
  return 0
end
if tonumber(redis.call('HGET', KEYS[1], 'forceStops') or '0') >= tonumber(ARGV[2]) then
  return 0
end
redis.call('HSET', KEYS[1], 'forceStops', ARGV[2], 'forceJob', ARGV[3])
return 1
