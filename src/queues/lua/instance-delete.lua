--[[
  Deletes a provider instance in one step, leaving a tombstone (the time of the deletion) so
  an operation accepted before it that still names it fails with provider_deleted (not
  unknown_provider, nor a configured provider of its name).

  KEYS[1] the instance's record   KEYS[2] the company's index   KEYS[3] the deployment's index
  KEYS[4] instances per master key id   KEYS[5] the instance's tombstone
  KEYS[6] the deployment's index of tombstones (zset, by when each lapses)
  ARGV[1] its member in KEYS[2]   ARGV[2] its member in KEYS[3] (and KEYS[6])
  ARGV[3] the tombstone's time to live (s; 0: none, for a save taken back)
  ARGV[4] the revision expected ('' = any)   ARGV[5] now (ms): the tombstone's value
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
if tonumber(ARGV[3]) > 0 then
  redis.call('SET', KEYS[5], ARGV[5], 'EX', ARGV[3])
  redis.call('ZADD', KEYS[6], tonumber(ARGV[5]) + tonumber(ARGV[3]) * 1000, ARGV[2])
end
return {'ok'}
