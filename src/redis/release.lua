-- Release one hold of a reentrant lock; idempotent per hold.
--
-- KEYS[1]  the lock hash
-- ARGV[1]  owner id
-- ARGV[2]  this hold's latch field ("owner#hold"), written when a re-entry is undone so
--          that a retry of the same release (after a lost reply) does not decrement twice
-- ARGV[3]  lease in milliseconds, re-applied while outer holds remain
-- ARGV[4]  the channel that waiters subscribe to
--
-- Returns 2 when the lock was freed and the release published, 1 when an outer hold of
-- the same owner remains (or this hold was already undone), 0 when the owner does not
-- hold the lock (its lease ran out, it was deleted, or a retried final release).
if redis.call('hexists', KEYS[1], ARGV[2]) == 1 then
  return 1
end
if redis.call('hexists', KEYS[1], ARGV[1]) == 0 then
  return 0
end
local count = redis.call('hincrby', KEYS[1], ARGV[1], -1)
if count > 0 then
  redis.call('hset', KEYS[1], ARGV[2], 1)
  redis.call('pexpire', KEYS[1], ARGV[3])
  return 1
end
redis.call('del', KEYS[1])
redis.call('publish', ARGV[4], 'released')
return 2
