-- Lease extension, shared by acquire.lua, release.lua and renew.lua (prepended to each by
-- scripts.rs).
--
-- extend_lease(key, ms) makes `key` live at least `ms` more milliseconds and never
-- shortens it: one owner's holds may come with different leases (a re-entry through
-- another layer or instance, each renewed by its own watchdog), and whichever asked for
-- the longest must keep it. A key without expiry (PTTL -1) gets one. PEXPIRE's GT flag
-- is not used: it would leave such a key persistent, and needs Redis 7.
local function extend_lease(key, ms)
  if redis.call('pttl', key) < tonumber(ms) then
    redis.call('pexpire', key, ms)
  end
end

