--[[
  Merges small facts into a job's checkpoint (kept across its attempts), only while the job
  exists: a stale attempt that writes after its job was removed must not bring the job's
  hash back holding only this field.

  KEYS[1] the job's hash   ARGV[1] the facts to merge (a JSON object)

  Returns 1 when written, 0 when the job is gone.
]]
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end
local current = redis.call('HGET', KEYS[1], 'lo:checkpoint')
local merged = current and cjson.decode(current) or {}
for k, v in pairs(cjson.decode(ARGV[1])) do
  merged[k] = v
end
redis.call('HSET', KEYS[1], 'lo:checkpoint', cjson.encode(merged))
return 1
