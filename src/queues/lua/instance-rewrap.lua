--[[
  Replaces an instance's sealed credentials by the same ones re-wrapped under the current
  master key, only while the record still holds what was read (a save in between wins).
  The revision stays: the credentials did not change.

  KEYS[1] the instance's record   KEYS[2] instances per master key id
  ARGV[1] the sealed value read   ARGV[2] the re-wrapped one   ARGV[3] its master key id
  Returns 1 when replaced, 0 when the record changed meanwhile (or is gone).
]]
if redis.call('HGET', KEYS[1], 'sealed') ~= ARGV[1] then return 0 end
local oldKid = redis.call('HGET', KEYS[1], 'kid')
if oldKid ~= ARGV[3] then
  if oldKid and redis.call('HINCRBY', KEYS[2], oldKid, -1) <= 0 then redis.call('HDEL', KEYS[2], oldKid) end
  redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
end
redis.call('HSET', KEYS[1], 'sealed', ARGV[2], 'kid', ARGV[3])
return 1
