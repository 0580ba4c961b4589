--[[
  An operator acknowledges a lease's failures: its entry leaves the failures index (and the
  attention list) in one step, so a failure noted meanwhile is either acknowledged with the
  rest or noted after, never lost half-way.

  KEYS[1] failures (hash lane id -> JSON kinds)   KEYS[2] failures by time (zset)
  ARGV[1] lane id
  Returns the entry acknowledged (JSON), or false when there was none.
]]
local text = redis.call('HGET', KEYS[1], ARGV[1])
if not text then
  return false
end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return text
