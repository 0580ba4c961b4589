--[[
  Replaces a key's value only while it still holds the given one: a refused enqueue turns
  the idempotency key it set into a short-lived refusal, never one a later request set.

  KEYS[1] key   ARGV[1] expected value   ARGV[2] new value   ARGV[3] its time to live (ms)
  Returns 1 when replaced, else 0.
]]
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return 1
end
return 0
