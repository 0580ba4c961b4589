--[[
  Deletes a provider instance in one step, leaving a tombstone so an operation that still
  names it fails with provider_deleted (not unknown_provider).

  KEYS[1] the instance's record   KEYS[2] the company's index   KEYS[3] the deployment's index
  KEYS[4] instances per master key id   KEYS[5] the instance's tombstone
  ARGV[1] its member in KEYS[2]   ARGV[2] its member in KEYS[3]
  ARGV[3] the tombstone's time to live (s; 0: none, for a save taken back)
  ARGV[4] the revision expected ('' = any)
  Returns {'ok'} | {'missing'} | {'conflict', rev}.
]]
if redis.call('EXISTS', KEYS[1]) == 0 then return {'missing'} end
local rev = redis.call('HGET', KEYS[1], 'rev')
if ARGV[4] ~= '' and rev ~= ARGV[4] then return {'conflict', rev or ''} end
local kid = redis.call('HGET', KEYS[1], 'kid')
if kid and redis.call('HINCRBY', KEYS[4], kid, -1) <= 0 then redis.call('HDEL', KEYS[4], kid) end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[2])
if tonumber(ARGV[3]) > 0 then redis.call('SET', KEYS[5], rev or '0', 'EX', ARGV[3]) end
return {'ok'}
