-- Writes a quorum grant's fencing token back to one master of the granting majority (see
-- src/redis/quorum/fencing.rs for why tokens then increase across the quorum).
--
-- KEYS[1]  the lock hash (or the semaphore's hash)
-- KEYS[2]  the fencing counter
-- ARGV[1]  the holder's id
-- ARGV[2]  the grant's token: the highest token the granting majority issued for it
-- ARGV[3]  how long the fencing counter outlives its last use, in milliseconds
-- ARGV[4]  the hash field that keeps the hold's token ("token" for an exclusive hold,
--          "tok:" .. ARGV[1] for a permit)
--
-- The counter is raised to ARGV[2], never lowered. The hold's token is set to it while
-- ARGV[1] still holds the key here, so that its re-entries answer with the grant's token.
-- Returns 1 when ARGV[1] holds the key here, 0 otherwise (the counter is raised either
-- way). Tokens are below 2^53, so Lua's numbers compare them exactly.
local token = tonumber(ARGV[2])
local last = tonumber(redis.call('get', KEYS[2]) or '0') or 0
if last < token then
  redis.call('set', KEYS[2], ARGV[2], 'px', ARGV[3])
else
  redis.call('pexpire', KEYS[2], ARGV[3])
end
if redis.call('hexists', KEYS[1], ARGV[1]) == 1 then
  redis.call('hset', KEYS[1], ARGV[4], ARGV[2])
  return 1
end
return 0
