--[[
  Removes records of a company's ended operations before their retention, to bring it under
  its bytes budget: only jobs that still have ended (an operator's rerun meanwhile makes one
  live again, and it stays). A job here has no parent, children or logs that matter: lease-ops
  adds none, so its hash, its logs key and its entry in BullMQ's completed or failed set are all
  of it (pinned in test/company-bytes.test.ts).

  KEYS[1] bytes held, by company   KEYS[2] the company's counted jobs (job id -> bytes)
  KEYS[3] the company's counted jobs in order   KEYS[4] BullMQ completed   KEYS[5] BullMQ failed
  KEYS[6..] for each job id in ARGV[2..], its hash then its logs key
  ARGV[1] company   ARGV[2..] job ids

  Returns {held, removed}.
]]
--- @include "bytes"
local company = ARGV[1]
local freed, removed = 0, 0
for i = 2, #ARGV do
  local jobId = ARGV[i]
  local jobKey, logsKey = KEYS[4 + 2 * (i - 1)], KEYS[5 + 2 * (i - 1)]
  if redis.call('HEXISTS', jobKey, 'finishedOn') == 1 then
    redis.call('ZREM', KEYS[4], jobId)
    redis.call('ZREM', KEYS[5], jobId)
    redis.call('DEL', jobKey, logsKey)
    removed = removed + 1
    freed = freed + tonumber(redis.call('HGET', KEYS[2], jobId) or '0')
    redis.call('HDEL', KEYS[2], jobId)
    redis.call('ZREM', KEYS[3], jobId)
  end
end
local held = uncountBytes(KEYS[1], company, freed)
return {held, removed}
