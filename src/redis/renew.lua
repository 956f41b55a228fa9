-- Extend the leases of many held locks in one call (the watchdog's batch).
--
-- KEYS[i]     a lock hash
-- ARGV[2i-1]  the owner id that should hold KEYS[i]
-- ARGV[2i]    the new lease for KEYS[i] in milliseconds
--
-- Returns one entry per key: 1 when the owner still holds it (lease reset), 0 when it
-- does not (expired, deleted, or replaced by a value of another type), so that one bad
-- key cannot fail the renewal of the others.
local renewed = {}
for i, key in ipairs(KEYS) do
  local held = redis.pcall('hexists', key, ARGV[2 * i - 1])
  if held == 1 then
    redis.call('pexpire', key, ARGV[2 * i])
    renewed[i] = 1
  else
    renewed[i] = 0
  end
end
return renewed
