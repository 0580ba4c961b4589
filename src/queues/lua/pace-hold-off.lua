--[[
  The service answered 429 with Retry-After: every replica holds this bucket back until then.

  KEYS[1] the bucket (see pace-take.lua)   ARGV[1] ms to hold off

  Returns the epoch ms (Redis clock) the bucket is held off until.
]]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local stored = redis.call('HMGET', KEYS[1], 'tat', 'until')
local heldUntil = math.max(tonumber(stored[2]) or 0, now + tonumber(ARGV[1]))
redis.call('HSET', KEYS[1], 'until', heldUntil)
redis.call('PEXPIRE', KEYS[1], math.ceil(math.max(tonumber(stored[1]) or now, heldUntil) - now) + 60000)
return heldUntil
