--[[
  Counts an accepted operation's bytes against its company's budget (what its job and its
  history may hold in Redis), or refuses it. A job id counted already (a retry of the same
  request) is not counted twice.

  KEYS[1] bytes held, by company (hash company -> bytes)
  KEYS[2] the company's counted jobs (hash job id -> bytes)
  KEYS[3] the company's counted jobs in the order they came (zset job id -> when)
  ARGV[1] company   ARGV[2] job id   ARGV[3] bytes   ARGV[4] the company's budget (0: none)
  ARGV[5] now (ms)

  Returns {'ok', held} or {'full', held}.
]]
local company, jobId, bytes, budget = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local held = tonumber(redis.call('HGET', KEYS[1], company) or '0')
if redis.call('HEXISTS', KEYS[2], jobId) == 1 then
  return {'ok', held}
end
if budget > 0 and held + bytes > budget then
  return {'full', held}
end
redis.call('HSET', KEYS[2], jobId, bytes)
redis.call('ZADD', KEYS[3], ARGV[5], jobId)
return {'ok', redis.call('HINCRBY', KEYS[1], company, bytes)}
