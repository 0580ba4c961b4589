--[[
  Deletes a key only while it still holds the given value: a refused enqueue takes back the
  idempotency key it set, never one a later request set meanwhile.

  KEYS[1] key   ARGV[1] expected value
  Returns 1 when deleted, else 0.
]]
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
