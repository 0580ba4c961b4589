--[[
  Appends one event (field/value pairs) to a lease's history: a list of its last 200 events,
  kept a week past the last one. Each entry is Redis' time in ms (one clock for every
  replica's events) and the pairs, joined by the unit separator (\31), which no value holds
  (lease-history.ts takes it out of what it sends). A list, not a stream: an idle lease's few
  events cost a few hundred bytes, where a stream's node costs several kilobytes.
]]
local function historyAppendJoined(key, joined)
  local time = rcall('TIME')
  local ms = tostring(tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000))
  if rcall('RPUSH', key, ms .. '\31' .. joined) > 200 then
    rcall('LTRIM', key, -200, -1)
  end
  rcall('PEXPIRE', key, 604800000)
end

local function historyAppend(key, fields)
  historyAppendJoined(key, table.concat(fields, '\31'))
end
