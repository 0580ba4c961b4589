--[[
  Looks at a company's oldest counted entries: one whose key is gone (a job removed after its
  retention, refused or dropped; a history expired) is no longer counted; an ended job, and a
  lease's history, are records that may go before their retention when the company is at its
  budget (company-bytes.ts).

  KEYS[1] bytes held, by company   KEYS[2] the company's counted entries (id -> bytes)
  KEYS[3] the company's counted entries in order
  KEYS[4..] for each id in ARGV[2..], its key (a job's hash; for "h:<laneId>", the history)
  ARGV[1] company   ARGV[2..] ids (the oldest of KEYS[3])

  Returns {held, removableId1, bytes1, removableId2, bytes2, ...}, oldest first.
]]
--- @include "bytes"
local company = ARGV[1]
local removable = {}
local freed = 0
for i = 2, #ARGV do
  local id, key = ARGV[i], KEYS[i + 2]
  local bytes = tonumber(redis.call('HGET', KEYS[2], id) or '0')
  if redis.call('EXISTS', key) == 0 then
    if redis.call('HDEL', KEYS[2], id) == 1 then freed = freed + bytes end
    redis.call('ZREM', KEYS[3], id)
  elseif bytes > 0 and (string.sub(id, 1, 2) == 'h:' or redis.call('HEXISTS', key, 'finishedOn') == 1) then
    removable[#removable + 1] = id
    removable[#removable + 1] = bytes
  end
end
local held = uncountBytes(KEYS[1], company, freed)
local reply = {held}
for _, v in ipairs(removable) do reply[#reply + 1] = v end
return reply
