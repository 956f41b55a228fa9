-- A snapshot of a key's lock or semaphore for an operator; changes nothing.
--
-- KEYS[1]  the lock hash, or the semaphore hash
-- KEYS[2]  its fencing counter
-- ARGV[1]  "1" for the semaphore (permit_acquire.lua), "0" for the lock
--
-- Returns snapshot() (snapshot.lua), or WRONGTYPE when KEYS[1] is not a hash.
local info, refused = snapshot(KEYS[1], KEYS[2], ARGV[1] == '1')
if not info then
  return refused
end
return info
