-- Write a value only if the writer's fencing token is newer than the last accepted one.
--
-- KEYS[1]  the fenced value: a hash {token, value}
-- ARGV[1]  the writer's fencing token
-- ARGV[2]  the value
--
-- Returns {1, token} when the value was written, {0, stored} when a write with a token
-- equal to or above ARGV[1] was accepted before (the writer's lock has been taken over).
-- Tokens are below 2^53, so Lua's numbers compare them exactly.
local stored = tonumber(redis.call('hget', KEYS[1], 'token') or '0') or 0
local token = tonumber(ARGV[1])
if token <= stored then
  return {0, stored}
end
redis.call('hset', KEYS[1], 'token', ARGV[1], 'value', ARGV[2])
return {1, token}
