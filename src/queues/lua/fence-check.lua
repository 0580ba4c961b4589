--[[
  Whether an attempt still holds its lane, and for how long at least: its fencing token
  against the lane's current one, and its own BullMQ lock (the lock key must still hold this
  attempt's lock token) with the time left on it. No successor can start before that lock
  expires (a stalled job is re-run only after it has), so the caller may trust its fence
  until then, counted from when it sent this check. A lock that is gone, or that holds
  another token (a successor's), makes the attempt stale: trusting its time would trust the
  successor's.

  KEYS[1] lane holder hash   KEYS[2] the job's BullMQ lock key
  ARGV[1] the attempt's fencing token   ARGV[2] the attempt's BullMQ lock token

  Returns {1, lock ms left} when current, {0, 0} when not.
]]
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] or redis.call('GET', KEYS[2]) ~= ARGV[2] then
  return {0, 0}
end
return {1, redis.call('PTTL', KEYS[2])}
