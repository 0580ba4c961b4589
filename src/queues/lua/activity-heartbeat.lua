--[[
  Extends an open activity and says whether a cancel was asked for it (a stop, release or
  destroy with cancelActiveWork). One whose TTL passed is gone for good: its heartbeat is
  refused and never opens the gate again.

  KEYS[1] the lease's activities
  ARGV[1] token   ARGV[2] ttl (ms) from now
  Returns {'ok', expiresAt, '1' | '0'} or {'gone'}.
]]
local rcall = redis.call
--- @include "activities"
local now = redisNow()
local value = rcall('HGET', KEYS[1], ARGV[1])
local ok, info = pcall(cjson.decode, value or '')
if not value or not ok or type(info) ~= 'table' or tonumber(info.expiresAt) == nil or tonumber(info.expiresAt) <= now then
  if value then
    rcall('HDEL', KEYS[1], ARGV[1])
  end
  return {'gone'}
end
info.expiresAt = now + tonumber(ARGV[2])
rcall('HSET', KEYS[1], ARGV[1], cjson.encode(info))
keepFor(KEYS[1], info.expiresAt)
return {'ok', tostring(info.expiresAt), info.cancel and '1' or '0'}
