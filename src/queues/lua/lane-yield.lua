--[[
  The executing head backs off before a retry: it keeps its place at the head, but is no
  longer executing. If a force-stop arrived while it executed (queued right behind it), the
  sanctioned exception now applies: the force-stop goes ahead and is handed off.

  KEYS[1] lane list   KEYS[2] lane executing hash   KEYS[3] lanes index   KEYS[4] fencing counter
  ARGV[1] job id   ARGV[2] token   ARGV[3] BullMQ job key prefix

  Returns 1, or 0 for a stale attempt.
]]
local rcall = redis.call
local listKey, execKey, lanesKey, fenceKey = KEYS[1], KEYS[2], KEYS[3], KEYS[4]

--- @include "hand-off"
local q = bullKeys(ARGV[3], false)

local holder = rcall('HMGET', execKey, 'job', 'token', 'front')
if holder[1] ~= ARGV[1] or holder[2] ~= ARGV[2] then
  return 0
end
rcall('DEL', execKey)
local front = holder[3]
if front and rcall('LPOS', listKey, front) then
  rcall('LREM', listKey, 1, front)
  rcall('LPUSH', listKey, front)
  handOff(q, execKey, fenceKey, front, listKey .. ':c')
end
return 1
