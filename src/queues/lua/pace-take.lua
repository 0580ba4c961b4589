--[[
  Takes the next turn of a shared request budget (GCRA): the caller may send its request
  after the returned number of ms. Every worker replica on this Redis shares one schedule
  per bucket, so N replicas together send no faster than the limit. Redis' own clock is
  used, so replicas with skewed clocks still agree.

  KEYS[1] the bucket (hash: tat = theoretical arrival time of the next request, until =
          held off until, both epoch ms)
  ARGV[1] ms between requests at the limit   ARGV[2] burst (requests that may go at once)
  ARGV[3] '1' to take a turn, '0' only to ask how long the bucket is still held off
  ARGV[4] the longest wait the caller accepts (ms; -1: any): a turn further away is not taken

  Returns the ms to wait before sending, or minus the wait when it is longer than ARGV[4].
]]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local interval = tonumber(ARGV[1])
local tau = (tonumber(ARGV[2]) - 1) * interval

local stored = redis.call('HMGET', KEYS[1], 'tat', 'until')
local tat = math.max(tonumber(stored[1]) or now, now)
local heldUntil = tonumber(stored[2]) or 0
if ARGV[3] == '0' then
  return math.max(0, heldUntil - now)
end

local sendAt = math.max(now, tat - tau, heldUntil)
local maxWait = tonumber(ARGV[4])
if maxWait >= 0 and sendAt - now > maxWait then
  return -math.max(1, math.ceil(sendAt - now))
end
local nextTat = math.max(tat, sendAt) + interval
redis.call('HSET', KEYS[1], 'tat', nextTat)
-- Nothing stays behind once the bucket is idle again.
redis.call('PEXPIRE', KEYS[1], math.ceil(math.max(nextTat, heldUntil) - now) + 60000)
return math.ceil(sendAt - now)
