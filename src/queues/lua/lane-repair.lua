--[[
  The one recovery step for a lane, used by the periodic sweep and by a job that has just
  parked itself. It looks at the head and:
    - drops it when its job is gone (removed by an operator) or finished without the lane
      hearing of it (BullMQ failed it after too many stalls), then hands off the next;
    - hands it off when it is still parked (its hand-off raced a parking attempt, or the
      process that should have handed it off died);
    - makes its data readable when it is not JSON at all (written into Redis by hand or
      corrupted): BullMQ cannot load such a job, so it would stall for ever; as
      {"lo:unreadable":true} it loads, fails validation and fails for good, and the
      original text stays in the job's lo:unreadable-data field;
    - otherwise (waiting, active, backing off) marks the lane as seen.
  Every branch is conditional on what it reads in the same atomic step, so a repair that
  races a worker can only find the work already done.

  KEYS[1] lane list   KEYS[2] lane executing hash   KEYS[3] lanes index   KEYS[4] fencing counter
  ARGV[1] lane id   ARGV[2] now (ms)   ARGV[3] BullMQ job key prefix
  ARGV[4] parked threshold: a delayed head whose delay is at least this is parked, not
          backing off

  Returns {'forgotten'} | {'healthy'} | {'dropped', jobId, ...advance} | {'handed', jobId, r}
]]
local rcall = redis.call
local listKey, execKey, lanesKey, fenceKey = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local laneId, now, parkedDelay = ARGV[1], ARGV[2], tonumber(ARGV[4])

--- @include "hand-off"
local q = bullKeys(ARGV[3], false)

local head = rcall('LINDEX', listKey, 0)
if not head then
  rcall('ZREM', lanesKey, laneId)
  rcall('DEL', execKey)
  return {'forgotten'}
end

local jobKey = q.jobPrefix .. head
if rcall('EXISTS', jobKey) == 0 or rcall('HEXISTS', jobKey, 'finishedOn') == 1 then
  rcall('LPOP', listKey)
  forgetCoalescing(listKey .. ':c', head)
  if rcall('HGET', execKey, 'job') == head then
    rcall('DEL', execKey)
  end
  local advanced = advanceLane(q, listKey, execKey, fenceKey, lanesKey, laneId, now)
  return {'dropped', head, advanced[1], advanced[2], advanced[3]}
end

local data = rcall('HGET', jobKey, 'data')
if data and not pcall(cjson.decode, data) then
  rcall('HSET', jobKey, 'data', '{"lo:unreadable":true}', 'lo:unreadable-data', data)
  -- Its stalls were the unreadable data's doing, not a crashing worker's.
  rcall('HDEL', jobKey, 'defa', 'stc')
end

if rcall('ZSCORE', q.delayed, head) and (tonumber(rcall('HGET', jobKey, 'delay')) or 0) >= parkedDelay then
  return {'handed', head, handOff(q, execKey, fenceKey, head, listKey .. ':c')}
end

rcall('ZADD', lanesKey, 'XX', now, laneId)
return {'healthy'}
