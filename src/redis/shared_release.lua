-- Give back one shared hold of a read/write lock; idempotent per hold.
--
-- KEYS[1]  the lock hash (see shared_acquire.lua)
-- ARGV[1]  the shared holder's field: "r:" .. owner id
-- ARGV[2]  this hold's release id ("r:owner#hold"; see permit_release.lua)
-- ARGV[3]  lease in milliseconds, re-applied while outer holds of the owner remain
-- ARGV[4]  the lock's channel
-- ARGV[5]  "1" on a Redis Cluster: publish with SPUBLISH (see release.lua)
-- ARGV[6]  the fencing token the hold was taken under, or "" not to check it
--
-- Returns {2} when the owner's shared hold ended (and, if it was the last hold of the key,
-- the lock was freed and the release published), {1} when an outer hold of the same owner
-- remains (or this hold was already undone), {0} when the owner holds the key shared no
-- more (its lease ran out, it was deleted, or a retried final release), or holds it under
-- another token than ARGV[6].
if redis.call('hexists', KEYS[1], ARGV[2]) == 1 then
  return {1}
end
local now = now_ms()
local held = redis.call('hmget', KEYS[1], ARGV[1], 'exp:' .. ARGV[1], 'token', 'mode')
local count, ends = tonumber(held[1]), tonumber(held[2])
if not count or not ends or ends <= now or (ARGV[6] ~= '' and tonumber(held[3]) ~= tonumber(ARGV[6])) then
  return {0}
end
if count > 1 then
  redis.call('hincrby', KEYS[1], ARGV[1], -1)
  redis.call('hset', KEYS[1], ARGV[2], 1)
  lease_holder(KEYS[1], ARGV[1], now, ARGV[3], ends)
  return {1}
end
forget_holder(KEYS[1], ARGV[1], redis.call('hgetall', KEYS[1]))
local readers = redis.call('hincrby', KEYS[1], 'readers', -1)
if held[4] ~= 'read' then
  -- A downgraded writer's shared hold: its exclusive hold still keeps everyone out.
  return {2}
end
if readers > 0 then
  -- Holders that crashed do not keep a waiting writer out past their own leases.
  readers = prune_holders(KEYS[1], 'r:', now)
  redis.call('hset', KEYS[1], 'readers', readers)
end
if readers <= 0 then
  redis.call(ARGV[5] == '1' and 'spublish' or 'publish', ARGV[4], 'released')
  redis.call('del', KEYS[1])
end
return {2}
