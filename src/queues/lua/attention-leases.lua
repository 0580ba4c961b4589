--[[
  Leases needing attention, each once whatever its reasons: every lane with a failure not
  made good, the lanes stopping since before the stuck cutoff that have none, the paused lanes
  that are neither, and the blocked lanes given that are none of the three. Walks the stuck
  and paused lanes (few: a stuck fleet is what the watchdog is for, pauses have a budget per
  company), never the failures.

  KEYS[1] failures by time (zset laneId)   KEYS[2] stopping since (zset laneId -> ms)
  KEYS[3] paused lanes (hash laneId)
  ARGV[1] the stuck cutoff (ms): stopping since then or before is stuck
  ARGV[2..] blocked lanes (the caller looked at their heads)
]]
local rcall = redis.call
local cutoff = tonumber(ARGV[1])
local function failed(laneId)
  return rcall('ZSCORE', KEYS[1], laneId) ~= false
end
local function stuck(laneId)
  local since = rcall('ZSCORE', KEYS[2], laneId)
  return since ~= false and tonumber(since) <= cutoff
end
local n = rcall('ZCARD', KEYS[1])
for _, laneId in ipairs(rcall('ZRANGEBYSCORE', KEYS[2], '-inf', cutoff)) do
  if not failed(laneId) then n = n + 1 end
end
for _, laneId in ipairs(rcall('HKEYS', KEYS[3])) do
  if not failed(laneId) and not stuck(laneId) then n = n + 1 end
end
for i = 2, #ARGV do
  local laneId = ARGV[i]
  if not failed(laneId) and not stuck(laneId) and rcall('HEXISTS', KEYS[3], laneId) == 0 then n = n + 1 end
end
return n
