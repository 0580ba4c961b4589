--[[
  Marks a lane as seen healthy by the sweep, or forgets it when it no longer exists.

  KEYS[1] lane list   KEYS[2] lanes index
  ARGV[1] lane id   ARGV[2] now (ms)

  Returns 1 when the lane still exists, 0 when it was forgotten.
]]
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('ZREM', KEYS[2], ARGV[1])
  return 0
end
redis.call('ZADD', KEYS[2], 'XX', ARGV[2], ARGV[1])
return 1
