--[[
  The executing head backs off before a retry: it keeps its place at the head, but is no
  longer executing, so a force-stop may now go ahead of it (the sanctioned exception).

  KEYS[1] lane executing hash
  ARGV[1] job id   ARGV[2] token

  Returns 1, or 0 for a stale attempt.
]]
local holder = redis.call('HMGET', KEYS[1], 'job', 'token')
if holder[1] ~= ARGV[1] or holder[2] ~= ARGV[2] then
  return 0
end
redis.call('DEL', KEYS[1])
return 1
