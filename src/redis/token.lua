-- Fencing tokens, shared by acquire.lua and release.lua (prepended to each by scripts.rs;
-- release.lua needs it only for a handoff on a lock hash that lost its token field).
--
-- next_token(fence, ttl) issues the token of a new acquisition: it must exceed every
-- token issued for the lock before, even when the counter `fence` was deleted or expired,
-- so it never falls below the server clock in microseconds. The counter is kept for
-- `ttl` milliseconds (10 minutes by default): after that only the clock orders tokens,
-- which tolerates a backward step of the clock of up to about `ttl` (the exact bound is in
-- the doc of RedisBackendBuilder::fence_ttl). Numbers are formatted by hand: Lua would
-- print them as 1.7e+15.
local function next_token(fence, ttl)
  local now = redis.call('time')
  local floor = tonumber(now[1]) * 1000000 + tonumber(now[2])
  local last = tonumber(redis.call('get', fence) or '0') or 0
  local token = string.format('%.0f', math.max(last + 1, floor))
  redis.call('set', fence, token, 'px', ttl)
  return token
end

