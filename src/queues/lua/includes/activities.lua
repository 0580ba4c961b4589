--[[
  A lease's activities (work inside its sandbox: an exec, a sync) in one hash: each token's
  {kind, since, expiresAt, cancel, lease} as JSON; `~closedAt` is when a stop, release or
  destroy of the lease last began (tokens are base64url after a dot: no `~`). Times are Redis'
  clock. The hash lives as long as its last activity could, plus a minute.
]]
local function redisNow()
  local time = rcall('TIME')
  return tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
end

-- Drops the activities whose holders stopped heartbeating (their TTL passed); returns the
-- open ones as {token, info}.
local function openActivities(key, now)
  local flat = rcall('HGETALL', key)
  local open = {}
  for i = 1, #flat, 2 do
    local field, value = flat[i], flat[i + 1]
    if string.sub(field, 1, 1) ~= '~' then
      local ok, info = pcall(cjson.decode, value)
      if not ok or type(info) ~= 'table' or tonumber(info.expiresAt) == nil or tonumber(info.expiresAt) <= now then
        rcall('HDEL', key, field)
      else
        open[#open + 1] = {field, info}
      end
    end
  end
  return open
end

-- Keeps the hash as long as its latest activity may live, plus a minute; gone when empty.
local function keepFor(key, untilMs)
  if rcall('HLEN', key) == 0 then
    return
  end
  local left = untilMs - redisNow() + 60000
  if left > rcall('PTTL', key) then
    rcall('PEXPIRE', key, left)
  end
end
