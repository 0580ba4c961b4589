--[[
  Makes a sandbox id a second name of the lane of the acquire that made it: from then on an
  operation naming the sandbox joins that lane (lane-push answers {'alias', lane} to one that
  would start a lane of the sandbox's own). Run by the acquire's attempt as soon as it learns
  the id, before anything it writes (its history, its record, its end) can show the id to
  anyone, so no operation naming the sandbox can find the name free.

  A sandbox id whose own lane has work (someone named the sandbox before its acquire said what
  it was) keeps that lane: two lanes for one sandbox at once would let two of its operations
  run together.

  KEYS[1] the alias key of the sandbox's own lane   KEYS[2] that lane's list
  KEYS[3] that lane's holder
  ARGV[1] the acquire's lane id   ARGV[2] how long the name lasts without use (ms)

  Returns 'new' (named now), 'named' (already: its time is renewed), 'busy' (the sandbox's
  lane has work), or 'taken' (the name belongs to another lane).
]]
local rcall = redis.call
local held = rcall('GET', KEYS[1])
if held == ARGV[1] then
  rcall('PEXPIRE', KEYS[1], ARGV[2])
  return 'named'
end
if held then
  return 'taken'
end
if rcall('EXISTS', KEYS[2]) == 1 or rcall('EXISTS', KEYS[3]) == 1 then
  return 'busy'
end
rcall('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 'new'
