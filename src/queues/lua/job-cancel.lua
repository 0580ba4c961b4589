--[[
  Asks an executing acquire to stop: its attempt reads the mark at its next step (before each
  provider call, and before its end is recorded) and fails with `cancelled`, its sandbox then
  destroyed by the abandon-acquire clean-up. Set only on a job that exists and has no outcome,
  so a job removed meanwhile is not brought back as a partial hash.

  KEYS[1] the job's hash
  ARGV[1] who cancelled it
  Returns 'requested', 'ended' (it has an outcome), or 'gone'.
]]
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 'gone'
end
if redis.call('HEXISTS', KEYS[1], 'lo:outcome') == 1 then
  return 'ended'
end
redis.call('HSET', KEYS[1], 'lo:cancel', ARGV[1])
return 'requested'
