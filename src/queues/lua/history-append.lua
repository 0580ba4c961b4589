--[[
  Appends one event to a lease's history (see includes/history.lua).

  KEYS[1] the lease's history list
  ARGV[1] the event's field/value pairs, joined by the unit separator (historyEntry in
  lease-history.ts)
]]
local rcall = redis.call
--- @include "history"
historyAppendJoined(KEYS[1], ARGV[1])
return 1
