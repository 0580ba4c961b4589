--[[
  Adds the marker that wakes idle workers when jobs wait and the queue takes them. A closing
  worker sends this once its blocked fetch is gone: Redis may have served the last wake-up to
  that fetch after its socket closed on the worker's side, and then no idle worker would look
  before its block timeout.

  KEYS[1] BullMQ wait   KEYS[2] BullMQ meta   KEYS[3] BullMQ active   KEYS[4] BullMQ marker
  Returns 1 when the marker was added, else 0.
]]
if redis.call('LLEN', KEYS[1]) == 0 then return 0 end
local attrs = redis.call('HMGET', KEYS[2], 'paused', 'concurrency')
if attrs[1] then return 0 end
if attrs[2] and redis.call('LLEN', KEYS[3]) >= tonumber(attrs[2]) then return 0 end
redis.call('ZADD', KEYS[4], 0, '0')
return 1
