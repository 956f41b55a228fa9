-- Fencing tokens, shared by acquire.lua, permit_acquire.lua and release.lua (prepended to
-- each by scripts.rs; release.lua needs it only for a handoff).
--
-- next_token(fence, ttl, block) issues the token of a new acquisition: it must exceed every
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
-- Tokens are whole numbers up to 2^53 - 1: Lua's numbers (doubles) hold them exactly, and
-- so do the integer replies Redis makes of them; one past that, n + 1 rounds back to n.
-- A stored token or counter that is not such a number (set by hand, or pushed to the
-- edge) refuses the call with a BADTOKEN error, before the script writes anything: issuing
-- after it could repeat a token or go below one. The clock reaches 2^53 microseconds in
-- the year 2255.
local MAX_TOKEN = 9007199254740991

-- stored_token(value, name, above) is `value` as a number, or raises BADTOKEN when it is
-- not a whole number or leaves no room for `above` more tokens after it.
local function stored_token(value, name, above)
  local n = string.find(value, '^%d+$') and tonumber(value)
  if not n or n > MAX_TOKEN - above then
    error({err = 'BADTOKEN ' .. name .. ' holds ' .. string.format('%q', value)
      .. ', which leaves no exact fencing token after it (tokens are whole numbers up to '
      .. '2^53 - 1); delete or lower it'})
  end
  return n
end

-- `block` more tokens are reserved above the new one (acquire.lua) and must stay exact.
local function next_token(fence, ttl, block)
  local now = redis.call('time')
  local token = now[1] .. string.sub('00000' .. now[2], -6)
  local last = redis.call('get', fence)
  if last and (#last >= #token or not string.find(last, '^%d+$')) then
    local n = stored_token(last, 'the fencing counter ' .. fence, 1 + (tonumber(block) or 0))
    if n >= tonumber(token) then
      token = string.format('%d', n + 1)
    end
  end
  redis.call('set', fence, token, 'px', ttl)
  return token
end
