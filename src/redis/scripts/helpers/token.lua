-- Fencing tokens, shared by acquire.lua and release.lua (prepended to each by scripts.rs;
-- release.lua needs it only for a handoff on a lock hash that lost its token field).
--
-- next_token(fence, ttl) issues the token of a new acquisition: it must exceed every
-- token issued for the lock before, even when the counter `fence` was deleted or expired,
-- so it never falls below the server clock in microseconds. The counter is kept for
-- `ttl` milliseconds (10 minutes by default): after that only the clock orders tokens,
-- which tolerates a backward step of the clock of up to about `ttl` (the exact bound is in
-- the doc of RedisBackendBuilder::fence_ttl).
--
-- Tokens are decimal strings, compared and built as strings where possible: converting a
-- 16-digit number (tonumber, string.format '%.0f') cost a Redis command's worth of
-- instructions. The clock is whole seconds then six digits of microseconds, so it has no
-- leading zero and a shorter decimal is a smaller number; the counter is a number only
-- when it is not below the clock (more than one token per microsecond, or the clock
-- stepped back), which is rare. Lua would print numbers as 1.7e+15, hence '%d'.
local function next_token(fence, ttl)
  local now = redis.call('time')
  local token = now[1] .. string.sub('00000' .. now[2], -6)
  local last = redis.call('get', fence)
  if last and #last >= #token then
    local n = tonumber(last)
    if n and n >= tonumber(token) then
      token = string.format('%d', n + 1)
    end
  end
  redis.call('set', fence, token, 'px', ttl)
  return token
end
