--[[
  The frame of a script answered once (ANSWERED_ONCE in lua-scripts.ts): the script's own text
  takes the place of the line that says so below. A call whose reply was lost is sent again by
  ioredis when it reconnects; run again, it answers what its first run answered, and does
  nothing more.

  KEYS[#KEYS] this call's answer key (<prefix>:answer:<mark>, a mark of its own), taken off
  before the script runs, so the script sees its own keys only
  ARGV[#ARGV] how long the answer is kept (ms), taken off likewise

  The answer is kept as JSON (cjson): arrays without holes, strings, and integers of at most
  14 digits come back as they went; these scripts answer nothing else. Under maxmemory with
  noeviction the answer may not be kept: the call still answers, and only a resend of it then
  runs again (as before there was a frame).
]]
local answerKey = table.remove(KEYS)
local keptMs = table.remove(ARGV)
local answered = redis.call('GET', answerKey)
if answered then
  return cjson.decode(answered)[1]
end
local answer = (function()
--- @wrapped
end)()
redis.pcall('SET', answerKey, cjson.encode({answer}), 'PX', keptMs)
return answer
