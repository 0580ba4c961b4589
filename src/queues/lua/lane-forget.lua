--[[
  Takes out of a lane the waiting jobs an operator removed from BullMQ (Bull Board's clean),
  so they stop counting against the lease's, environment's and company's limits at once
  instead of when the lane reaches them. The head is left to lane-repair.

  KEYS[1..18] the lane keys (see includes/lane.lua)
  ARGV[1] lane id   ARGV[2] BullMQ job key prefix   ARGV[3] the removed job's id, or '' to
  look at every waiting job of the lane
  Returns how many it took out.
]]
local rcall = redis.call
--- @include "lane"
local k = laneKeys(KEYS)
local laneId, jobPrefix, only = ARGV[1], ARGV[2], ARGV[3]

local candidates = only ~= '' and {only} or rcall('LRANGE', k.list, 1, -1)
local head = rcall('LINDEX', k.list, 0)
local taken = 0
for i = 1, #candidates do
  local jobId = candidates[i]
  if jobId ~= head and rcall('EXISTS', jobPrefix .. jobId) == 0 and rcall('LREM', k.list, 1, jobId) > 0 then
    forgetCoalescing(k, jobId)
    rcall('ZREM', k.backingOff, jobId)
    taken = taken + 1
  end
end
if taken > 0 then
  recount(k, laneId)
end
return taken
