-- An exclusive acquisition stops waiting (timed out, cancelled, failed): it leaves the
-- waiting writers and the line of waiting holders.
--
-- KEYS[1]  the lock hash
-- KEYS[2]  the waiting writers of the key's read/write lock (see shared_acquire.lua)
-- KEYS[3]  the line of holders waiting for the lock (see line.lua)
-- KEYS[4]  the same holders with the time up to which each is known to wait
-- ARGV[1]  the holder id
-- ARGV[2]  the channel that waiters subscribe to
-- ARGV[3]  "1" on a Redis Cluster: publish on sharded pub/sub (see release.lua)
-- ARGV[4]  "1" to wake the key's waiters if the holder was a registered waiting writer
--          (new shared holds queue behind it)
--
-- The key's waiters are also woken when the holder left the line of a free lock: it may
-- have been the head, whose turn the others wait for; and when a release had granted the
-- lock to the holder, which gives up without having claimed it (release.lua): the grant
-- is freed at once rather than when its lease runs out. Returns 1 when they were woken.
local writer = redis.call('zrem', KEYS[2], ARGV[1]) == 1
local lined = leave_line(KEYS[3], KEYS[4], ARGV[1])
if redis.call('hget', KEYS[1], 'granted') == ARGV[1] then
  redis.call(ARGV[3] == '1' and 'spublish' or 'publish', ARGV[2], 'released')
  redis.call('del', KEYS[1])
  line_woken(KEYS[4])
  return 1
end
if (writer and ARGV[4] == '1') or (lined and redis.call('exists', KEYS[1]) == 0) then
  redis.call(ARGV[3] == '1' and 'spublish' or 'publish', ARGV[2], 'released')
  return 1
end
return 0
