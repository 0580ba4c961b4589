--[[
  Notes the sandbox an acquire handed out as the lease's acquired one (one lease, one
  sandbox: lease-records.ts), for the lane's holder only: an attempt that lost its turn
  notes nothing.

  KEYS[1] lease record hash   KEYS[2] the lane's holder
  ARGV[1] the attempt's fencing token   ARGV[2] the id the acquire was enqueued under
  ARGV[3] the sandbox   ARGV[4] the record's ttl (s)   ARGV[5] the acquire's job id (which
  acquire handed the sandbox out: its clean-up may destroy it, another's may not)

  Returns 1 when noted, 0 for an attempt that no longer holds the lane.
]]
if redis.call('HGET', KEYS[2], 'token') ~= ARGV[1] then
  return 0
end
redis.call('HSET', KEYS[1], 'acquiredAs', ARGV[2], 'acquiredSandbox', ARGV[3], 'acquiredBy', ARGV[5])
redis.call('EXPIRE', KEYS[1], ARGV[4])
return 1
