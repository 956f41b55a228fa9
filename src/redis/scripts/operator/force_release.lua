-- Free a key's lock or semaphore whatever holds it (an operator's force-release), fenced.
--
-- KEYS[1]  the lock hash, or the semaphore hash
-- KEYS[2]  its fencing counter
-- ARGV[1]  "1" for the semaphore (permit_acquire.lua), "0" for the lock
-- ARGV[2]  the channel its waiters subscribe to
-- ARGV[3]  "1" on a Redis Cluster: publish with SPUBLISH (see release.lua)
-- ARGV[4]  how long the fencing counter outlives its last use, in milliseconds
--
-- Returns the snapshot of what was freed (snapshot.lua), or WRONGTYPE when KEYS[1] is not
-- a hash (not a lock: left alone).
--
-- The holders' fields go with the hash, so their renewals (renew.lua) and releases find
-- nothing: they are lost. The counter is set to the snapshot's token, the highest issued
-- or reserved, which is never below its own value: the next holder's token (token.lua) is
-- above every earlier one, also those a process issues in memory from a reserved block,
-- whose top the counter may no longer hold (deleted meanwhile). Waiting writers stay
-- registered (KEYS[1]:writers): they still wait.
local info, refused = snapshot(KEYS[1], KEYS[2], ARGV[1] == '1')
if not info then
  return refused
end
if redis.call('exists', KEYS[1]) == 0 then
  return info
end
-- Published first, as release.lua does: a PUBLISH the ACL user may not send fails the
-- call with the key still held.
redis.call(ARGV[3] == '1' and 'spublish' or 'publish', ARGV[2], 'released')
if info[5] > 0 then
  local ttl = math.max(redis.call('pttl', KEYS[2]), tonumber(ARGV[4]))
  redis.call('set', KEYS[2], string.format('%d', info[5]), 'px', ttl)
end
redis.call('del', KEYS[1])
return info
