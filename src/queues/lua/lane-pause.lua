--[[
  Pauses a lane, counting it against its company's paused lanes (a flood of pauses of leases
  nobody uses would otherwise leave entries with no count and no end).

  KEYS[1] paused lanes (hash laneId -> JSON who, since, lease)
  KEYS[2] paused lanes by company (hash companyId -> count)
  KEYS[3] the attention scope index (see indexScope in includes/lane.lua)
  ARGV[1] lane id   ARGV[2] the entry (JSON)   ARGV[3] company
  ARGV[4] most paused lanes the company may have (0: no limit)
  ARGV[5] '1' to refuse past it, '0' to go past it (an admin), saying so
  ARGV[6] the lane's entry in the scope index ('<company>\n<environment>\n<laneId>')

  Returns {'paused', count} (count: the company's paused lanes now), {'already', count},
  {'full', count} (refused), or {'over', count} (paused past the limit).
]]
local held = tonumber(redis.call('HGET', KEYS[2], ARGV[3]) or '0')
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then
  return {'already', held}
end
local limit = tonumber(ARGV[4])
local over = limit > 0 and held >= limit
if over and ARGV[5] == '1' then
  return {'full', held}
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[3], 0, ARGV[6])
held = redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
return {over and 'over' or 'paused', held}
