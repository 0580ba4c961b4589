--[[
  Saves a provider instance in one step: its record, its places in the company's and the
  deployment's index, the count of instances each master key wraps, and a new revision from
  the deployment's counter (a deleted and re-created instance never reuses one).

  KEYS[1] the instance's record (hash)      KEYS[2] the company's index (zset, by name)
  KEYS[3] the deployment's index (zset)     KEYS[4] instances per master key id (hash)
  KEYS[5] the revision counter              KEYS[6] the instance's tombstone
  ARGV[1] 'create' or 'update'   ARGV[2] the revision an update expects ('' = any)
  ARGV[3] its member in KEYS[2]  ARGV[4] its member in KEYS[3]   ARGV[5] now (ms)
  ARGV[6] most instances a company may hold (a create past it is refused; 0: no limit)
  ARGV[7..] field, value pairs (a `kid` field moves the instance's count to that key id)
  Returns {'ok', rev} | {'exists'} | {'missing'} | {'conflict', rev} | {'full', count}.
]]
local exists = redis.call('EXISTS', KEYS[1]) == 1
if ARGV[1] == 'create' and exists then return {'exists'} end
if ARGV[1] == 'update' and not exists then return {'missing'} end
local most = tonumber(ARGV[6])
if ARGV[1] == 'create' and most > 0 then
  local count = redis.call('ZCARD', KEYS[2])
  if count >= most then return {'full', count} end
end
local current = redis.call('HGET', KEYS[1], 'rev')
if ARGV[2] ~= '' and current ~= ARGV[2] then return {'conflict', current or ''} end

local oldKid = redis.call('HGET', KEYS[1], 'kid')
for i = 7, #ARGV, 2 do
  local field, value = ARGV[i], ARGV[i + 1]
  if field == 'kid' and value ~= oldKid then
    if oldKid then
      if redis.call('HINCRBY', KEYS[4], oldKid, -1) <= 0 then redis.call('HDEL', KEYS[4], oldKid) end
    end
    redis.call('HINCRBY', KEYS[4], value, 1)
  end
  redis.call('HSET', KEYS[1], field, value)
end

local rev = redis.call('INCR', KEYS[5])
redis.call('HSET', KEYS[1], 'rev', rev, 'updatedAt', ARGV[5])
if not exists then redis.call('HSET', KEYS[1], 'createdAt', ARGV[5]) end
redis.call('ZADD', KEYS[2], 0, ARGV[3])
redis.call('ZADD', KEYS[3], 0, ARGV[4])
redis.call('DEL', KEYS[6])
return {'ok', rev}
