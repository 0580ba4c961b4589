--[[
  What an operation of the lease waits for before it touches the sandbox:
    'close'   a stop, release or destroy: every open activity (with ARGV[2] '1', asked to
              cancel first, which their holders see on their next heartbeat); notes when
              the lease began closing while some were open (a force-stop, which waits for
              none, notes it too)
    'resume'  a resume (or an acquire): the open activities begun before the lease last
              began closing (of the episode that stop ended: a force-stop does not wait)
  Activities whose holders died are gone at their TTL.

  KEYS[1] the lease's activities
  ARGV[1] 'close' | 'resume'   ARGV[2] '1' to ask the open ones to cancel
  Returns {count, kinds (comma-separated, the first few), oldest since (ms), now}.
]]
local rcall = redis.call
--- @include "activities"
local now = redisNow()
local open = openActivities(KEYS[1], now)
local closedAt = tonumber(rcall('HGET', KEYS[1], '~closedAt') or '0')
local waiting, kinds, oldest = 0, {}, now
for i = 1, #open do
  local token, info = open[i][1], open[i][2]
  if ARGV[1] == 'close' or tonumber(info.since) < closedAt then
    waiting = waiting + 1
    if #kinds < 3 then
      kinds[#kinds + 1] = tostring(info.kind)
    end
    oldest = math.min(oldest, tonumber(info.since))
    if ARGV[2] == '1' and not info.cancel then
      info.cancel = true
      rcall('HSET', KEYS[1], token, cjson.encode(info))
    end
  end
end
-- With none open, no activity can be of this episode later: nothing to note.
if ARGV[1] == 'close' and #open > 0 then
  rcall('HSET', KEYS[1], '~closedAt', now)
end
return {waiting, table.concat(kinds, ','), tostring(oldest), tostring(now)}
