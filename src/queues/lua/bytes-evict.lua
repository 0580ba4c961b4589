--[[
  Removes records of a company's ended operations before their retention, to bring it under
  its bytes budget: only jobs that still have ended (an operator's rerun meanwhile makes one
  live again, and it stays). A job here has no parent, children or logs that matter: lease-ops
  adds none, so its hash, its logs key and its entry in BullMQ's completed or failed set are all
  of it (pinned in test/company-bytes.test.ts). The events it left in its lease's history stay:
  up to ARGV[2] bytes of its count move to the history's own entry ("h:<laneId>"), counted until
  the history expires or goes the same way (an entry "h:<laneId>" here deletes that history).

  KEYS[1] bytes held, by company   KEYS[2] the company's counted entries (id -> bytes)
  KEYS[3] the company's counted entries in order   KEYS[4] BullMQ completed   KEYS[5] BullMQ failed
  KEYS[6..] for each id in ARGV[4..], its hash then its logs key (for "h:<laneId>": the
  history's key twice)
  ARGV[1] company   ARGV[2] the history share of a job's count   ARGV[3] now (ms)
  ARGV[4..] ids: job ids, and "h:<laneId>" for a lease's history

  Returns {held, removed}.
]]
--- @include "bytes"
local company, share = ARGV[1], tonumber(ARGV[2])
local freed, removed = 0, 0
local HISTORY_MOST = 65536
for i = 4, #ARGV do
  local id = ARGV[i]
  local key, logsKey = KEYS[6 + 2 * (i - 4)], KEYS[7 + 2 * (i - 4)]
  local bytes = tonumber(redis.call('HGET', KEYS[2], id) or '0')
  if string.sub(id, 1, 2) == 'h:' then
    redis.call('DEL', key)
    removed = removed + 1
    freed = freed + bytes
    redis.call('HDEL', KEYS[2], id)
    redis.call('ZREM', KEYS[3], id)
  elseif redis.call('HEXISTS', key, 'finishedOn') == 1 then
    redis.call('ZREM', KEYS[4], id)
    redis.call('ZREM', KEYS[5], id)
    redis.call('DEL', key, logsKey)
    removed = removed + 1
    redis.call('HDEL', KEYS[2], id)
    redis.call('ZREM', KEYS[3], id)
    -- Its lease's history keeps its events: that share stays counted, on the history.
    local history = 'h:' .. string.sub(id, 1, 22)
    local kept = tonumber(redis.call('HGET', KEYS[2], history) or '0')
    local moved = math.max(0, math.min(share, bytes, HISTORY_MOST - kept))
    if moved > 0 then
      redis.call('HSET', KEYS[2], history, kept + moved)
      redis.call('ZADD', KEYS[3], 'NX', ARGV[3], history)
    end
    freed = freed + bytes - moved
  end
end
local held = uncountBytes(KEYS[1], company, freed)
return {held, removed}
