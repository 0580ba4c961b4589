--[[
  Looks at a company's oldest counted jobs: one whose job is gone (removed after its
  retention, refused, dropped) is no longer counted; one that ended is a record that may go
  before its retention when the company is at its budget (company-bytes.ts).

  KEYS[1] bytes held, by company   KEYS[2] the company's counted jobs (job id -> bytes)
  KEYS[3] the company's counted jobs in order
  KEYS[4..] the jobs' hashes, one per job id in ARGV[2..]
  ARGV[1] company   ARGV[2..] job ids (the oldest of KEYS[3])

  Returns {held, endedJobId1, bytes1, endedJobId2, bytes2, ...}, oldest first.
]]
--- @include "bytes"
local company = ARGV[1]
local ended = {}
local freed = 0
for i = 2, #ARGV do
  local jobId, jobKey = ARGV[i], KEYS[i + 2]
  local bytes = tonumber(redis.call('HGET', KEYS[2], jobId) or '0')
  if redis.call('EXISTS', jobKey) == 0 then
    if redis.call('HDEL', KEYS[2], jobId) == 1 then freed = freed + bytes end
    redis.call('ZREM', KEYS[3], jobId)
  elseif redis.call('HEXISTS', jobKey, 'finishedOn') == 1 and bytes > 0 then
    ended[#ended + 1] = jobId
    ended[#ended + 1] = bytes
  end
end
local held = uncountBytes(KEYS[1], company, freed)
local reply = {held}
for _, v in ipairs(ended) do reply[#reply + 1] = v end
return reply
