--[[
  Whether an attempt still holds its lane, and for how long at least: its token against
  the lane's current one, and the time left on the job's BullMQ lock. No successor can
  start before that lock expires (a stalled job is re-run only after it has), so the
  caller may trust its fence until then, counted from when it sent this check.

  KEYS[1] lane executing hash   KEYS[2] the job's BullMQ lock key
  ARGV[1] the attempt's token

  Returns {1, lock ms left} when current (ms left < 0: no lock, trust nothing), {0, 0} when not.
]]
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] then
  return {0, 0}
end
return {1, redis.call('PTTL', KEYS[2])}
