--[[
  The one recovery step for a lane, used by the sweep and by a job that has just parked
  itself. It looks at the head and:
    - drops it when its job is gone (removed by an operator) or finished without the lane
      hearing of it, then hands off the next;
    - hands it off when it is still parked (its hand-off raced a parking attempt, or the
      process that should have handed it off died), or delayed without backing off;
    - makes its data readable when it is not JSON at all (written into Redis by hand or
      corrupted): BullMQ cannot load such a job, so it would stall for ever; as
      {"lo:unreadable":true} it loads, fails validation and fails for good, and the
      original text stays in the job's lo:unreadable-data field;
    - leaves a paused lane's parked head where it is (an operator unpauses it);
    - otherwise (waiting, active, backing off) marks the lane as seen.
  Every branch but 'forgotten' marks the lane as seen, so a sweep that repairs the quiet lanes
  a page at a time never meets the same lane twice in one pass.
  Every branch is conditional on what it reads in the same atomic step, so a repair that
  races a worker can only find the work already done.

  KEYS[1] lane list   KEYS[2] lane holder   KEYS[3] lane coalescing   KEYS[4] lanes index
  KEYS[5] fencing counter   KEYS[6] failures   KEYS[7] failures by time   KEYS[8] backing off
  KEYS[9] BullMQ delayed   KEYS[10] BullMQ wait   KEYS[11] BullMQ meta   KEYS[12] BullMQ active
  KEYS[13] BullMQ marker   KEYS[14] BullMQ events
  KEYS[15] counted lanes   KEYS[16] queued by company   KEYS[17] queued by environment
  KEYS[18] paused lanes
  (see includes/lane.lua)
  ARGV[1] lane id   ARGV[2] now (ms)   ARGV[3] BullMQ job key prefix
  ARGV[4] a job id to mark parked first ('' for none): a job that just parked itself

  Returns {'forgotten'} | {'healthy'} | {'paused', jobId} | {'dropped', jobId, ...advance} | {'handed', jobId, r}
]]
local rcall = redis.call
--- @include "lane"
local k = laneKeys(KEYS)
local laneId, now, jobPrefix = ARGV[1], ARGV[2], ARGV[3]

-- Only while it is parked (delayed, not backing off): a frozen attempt's late repair must
-- not flag the job another attempt now runs, or a later backoff of it would be cut short.
if ARGV[4] ~= '' and rcall('ZSCORE', k.delayed, ARGV[4]) and not rcall('ZSCORE', k.backingOff, ARGV[4]) then
  rcall('HSET', jobPrefix .. ARGV[4], 'lo:parked', '1')
end

local head = rcall('LINDEX', k.list, 0)
if not head then
  rcall('ZREM', k.lanes, laneId)
  rcall('DEL', k.holder)
  recount(k, laneId)
  return {'forgotten'}
end

local jobKey = jobPrefix .. head
if rcall('EXISTS', jobKey) == 0 or rcall('HEXISTS', jobKey, 'finishedOn') == 1 then
  dropHead(k, head)
  local advanced = advanceLane(k, jobPrefix, laneId, false)
  rcall('ZADD', k.lanes, 'XX', now, laneId)
  return {'dropped', head, advanced[1], advanced[2], advanced[3]}
end

-- Only a job that stalled can be one BullMQ failed to load: the others skip the decode.
local data = rcall('HEXISTS', jobKey, 'stc') == 1 and rcall('HGET', jobKey, 'data')
if data and not pcall(cjson.decode, data) then
  rcall('HSET', jobKey, 'data', '{"lo:unreadable":true}', 'lo:unreadable-data', data)
  -- Its stalls were the unreadable data's doing, not a crashing worker's.
  rcall('HDEL', jobKey, 'defa', 'stc')
end

-- A delayed head is backing off (lane-yield listed it) or parked: marked so, or not listed
-- as backing off and either not the holder (a job stored again under the id of one that
-- ended) or never started (the holder is left from a hand-off whose job was removed through
-- BullMQ's own API, and the job stored again under its id: a handed-off job is never delayed
-- before it has run).
-- A head listed as backing off whose retry is due and whose BullMQ timer is later than that
-- (BullMQ scores a delayed job due time x 4096, pinned by test/bullmq-contract.test.ts) was
-- parked after its retry started, by a path that did not say so: it is handed off too, not
-- left until that timer. Never before its retry is due: a worker that paused between its
-- yield and BullMQ's move sets a timer later than the due time it gave the lane, and the
-- retry must not start before the delay it chose.
local delayed = rcall('ZSCORE', k.delayed, head)
-- A paused lane keeps its head where it is until an operator unpauses it: nothing to repair.
if delayed and rcall('HEXISTS', k.paused, laneId) == 1 and rcall('HGET', k.holder, 'job') ~= head then
  rcall('ZADD', k.lanes, 'XX', now, laneId)
  return {'paused', head}
end
local retryDue = delayed and rcall('ZSCORE', k.backingOff, head)
local timerNotRetry = retryDue and tonumber(now) >= tonumber(retryDue)
  and math.floor(tonumber(delayed) / 4096) > tonumber(retryDue) + 1000
if delayed and (timerNotRetry or rcall('HEXISTS', jobKey, 'lo:parked') == 1 or (not retryDue and (rcall('HGET', k.holder, 'job') ~= head or rcall('HEXISTS', jobKey, 'processedOn') == 0))) then
  rcall('ZADD', k.lanes, 'XX', now, laneId)
  return {'handed', head, handOff(k, jobPrefix, head, false, laneId)}
end

-- A head backing off shows progress when its retry comes due: the sweep passes it by till then.
local due = retryDue and tonumber(retryDue)
rcall('ZADD', k.lanes, 'XX', (due and due > tonumber(now)) and due or now, laneId)
return {'healthy'}
