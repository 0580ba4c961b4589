--[[
  Changes a deployment's partition count only while it still holds the one that was checked
  (see layout.ts): two operators changing it at once cannot both think they did.

  KEYS[1] the layout key   ARGV[1] the count checked ('' for none)   ARGV[2] the new count
  Returns 1 when changed, else 0.
]]
if (redis.call('GET', KEYS[1]) or '') == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2])
  return 1
end
return 0
