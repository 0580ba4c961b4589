--[[
  Takes a job out of its company's index of operations by deadline (lane-push.lua) when it
  ended or went: a path that ended it without its lane's release or drop (an operator's
  removal, a crash between steps) left it there. Only then: a job an operator ran again
  cleared its end (BullMQ's reprocess) before it joins again, so a walk that read the job
  ended just before never takes out the entry of its new run.

  KEYS[1] the company's operations by deadline   KEYS[2] the job's hash
  ARGV[1] job id

  Returns 1 when the entry was taken out, else 0.
]]
local rcall = redis.call
if rcall('EXISTS', KEYS[2]) == 0 or rcall('HEXISTS', KEYS[2], 'finishedOn') == 1 then
  return rcall('ZREM', KEYS[1], ARGV[1])
end
return 0
