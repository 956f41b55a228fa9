-- Extend the leases of many held locks in one call (the watchdog's batch).
--
-- KEYS[i]     a lock hash
-- ARGV[2i-1]  the owner id that should hold KEYS[i]
-- ARGV[2i]    the new lease for KEYS[i] in milliseconds, or 0 to only check that the owner
--             still holds it (a hold without renewal, re-checked after Redis may have lost
--             data)
--
-- A renewal only extends (extend_lease, from lease.lua), never shortens: the same owner
-- may hold KEYS[i] with a longer lease that ARGV[2i] does not reflect, taken through
-- another backend (another layer or instance, with its own watchdog) or by a re-entry
-- that ran while this renewal was in flight. A plain PEXPIRE cut that lease short.
--
-- Returns one entry per key: 1 when the owner still holds it (its lease now at least
-- ARGV[2i]), 0 when it does not (expired, deleted, or replaced by a value of another
-- type), so that one bad key cannot fail the renewal of the others.
--
-- A hold that a release granted (release.lua) is claimed by its first renewal: the
-- "granted" mark goes, and the lease becomes the holder's own.
--
-- A holder with a lease of its own (shared holds, semaphore permits; see holders.lua) is
-- held only while that lease runs, and a renewal moves it too.
local renewed = {}
local now
for i, key in ipairs(KEYS) do
  local owner = ARGV[2 * i - 1]
  local held = redis.pcall('hmget', key, owner, 'exp:' .. owner, 'granted')
  renewed[i] = 0
  if type(held) == 'table' and held[1] then
    local ends = tonumber(held[2])
    if ends then
      now = now or now_ms()
    end
    if held[3] == owner then
      redis.call('hdel', key, 'granted')
    end
    if not ends or ends > now then
      if ARGV[2 * i] == '0' then
        renewed[i] = 1
      elseif ends then
        lease_holder(key, owner, now, ARGV[2 * i], ends)
        renewed[i] = 1
      else
        extend_lease(key, ARGV[2 * i])
        renewed[i] = 1
      end
    end
  end
end
return renewed
