--[[
  An operator runs a failed operation again: it goes back to BullMQ's wait list and joins its
  lane's tail right after (lane-push.lua), or when a worker takes it first (lane-acquire.lua).
  Until then no lane holds it, so the
  lane and company counts would not see it: this counts it against the same limits as an
  enqueue, with the reruns still on their way counted too, and records it as on its way (an
  enqueue counts the company's reruns on their way too: lane-push.lua).

  KEYS[1] the lane list   KEYS[2] queued by company   KEYS[3] queued by environment
  KEYS[4] BullMQ delayed  KEYS[5] BullMQ wait
  KEYS[6] the company's reruns on their way (zset "<environment>\n<jobId>" -> when asked)
  ARGV[1] job id   ARGV[2] company   ARGV[3] environment   ARGV[4] now (ms)
  ARGV[5] per-lane limit   ARGV[6] per-environment   ARGV[7] per-company   ARGV[8] queue (0: none)
  ARGV[9] '1' to refuse past a limit, '0' to go past it (an admin), saying so

  Returns {'ok'}, {'full', limit, count} or {'over', limit, count}.
]]
local jobId, company, environment = ARGV[1], ARGV[2], ARGV[3]
local laneId = string.sub(jobId, 1, 22)
-- A rerun leaves this set when it joins its lane (lane-acquire.lua), where it is counted from
-- then on; one removed or cancelled before that leaves it a day after it was asked for.
redis.call('ZREMRANGEBYSCORE', KEYS[6], '-inf', tonumber(ARGV[4]) - 86400000)
local pendingLane, pendingEnv = 0, 0
local members = redis.call('ZRANGE', KEYS[6], 0, -1)
for _, member in ipairs(members) do
  local nl = string.find(member, '\n', 1, true)
  local id = string.sub(member, nl + 1)
  if string.sub(id, 1, 22) == laneId then pendingLane = pendingLane + 1 end
  if string.sub(member, 1, nl - 1) == environment then pendingEnv = pendingEnv + 1 end
end
local pendingCompany = redis.call('ZCARD', KEYS[6])

local verdict = nil
local function check(limit, name, count)
  if verdict == nil and limit > 0 and count >= limit then verdict = {name, count} end
end
check(tonumber(ARGV[5]), 'lease', redis.call('LLEN', KEYS[1]) + pendingLane)
check(tonumber(ARGV[6]), 'environment', tonumber(redis.call('HGET', KEYS[3], company .. '\n' .. environment) or '0') + pendingEnv)
check(tonumber(ARGV[7]), 'company', tonumber(redis.call('HGET', KEYS[2], company) or '0') + pendingCompany)
local maxQueued = tonumber(ARGV[8])
if verdict == nil and maxQueued > 0 then
  -- As at enqueue: past the queue's limit, only a company over its fair share is refused.
  local queued = redis.call('ZCARD', KEYS[4]) + redis.call('LLEN', KEYS[5])
  local byCompany = tonumber(redis.call('HGET', KEYS[2], company) or '0') + pendingCompany
  local companies = redis.call('HLEN', KEYS[2]) + (byCompany == 0 and 1 or 0)
  if queued >= maxQueued and byCompany >= math.floor(maxQueued / companies) then verdict = {'queue', queued} end
end
if verdict ~= nil and ARGV[9] == '1' then
  return {'full', verdict[1], verdict[2]}
end
redis.call('ZADD', KEYS[6], ARGV[4], environment .. '\n' .. jobId)
-- The key goes a day after the last rerun asked for.
redis.call('PEXPIRE', KEYS[6], 86400000)
if verdict ~= nil then
  return {'over', verdict[1], verdict[2]}
end
return {'ok'}
