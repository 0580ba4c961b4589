-- A company's bytes held after `freed` of them are no longer counted (its entry goes at 0).
local function uncountBytes(heldKey, company, freed)
  local held = tonumber(redis.call('HGET', heldKey, company) or '0')
  if freed <= 0 then return held end
  held = redis.call('HINCRBY', heldKey, company, -freed)
  if held <= 0 then
    redis.call('HDEL', heldKey, company)
    held = 0
  end
  return held
end
