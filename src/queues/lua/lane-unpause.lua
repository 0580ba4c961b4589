--[[
  Unpauses a lane, and takes it off its company's count of paused lanes (an entry from
  before pauses recorded their lease was never counted).

  KEYS[1] paused lanes (hash laneId -> JSON who, since, lease)
  KEYS[2] paused lanes by company (hash companyId -> count)
  ARGV[1] lane id

  Returns 1 when it was paused, 0 when not.
]]
local entry = redis.call('HGET', KEYS[1], ARGV[1])
if not entry then
  return 0
end
redis.call('HDEL', KEYS[1], ARGV[1])
local ok, parsed = pcall(cjson.decode, entry)
local company = ok and type(parsed) == 'table' and type(parsed.lease) == 'table' and parsed.lease.companyId or nil
if type(company) == 'string' and redis.call('HINCRBY', KEYS[2], company, -1) <= 0 then
  redis.call('HDEL', KEYS[2], company)
end
return 1
