-- Give back one shared hold of a read/write lock; idempotent per hold.
--
-- KEYS[1]  the lock hash (see shared_acquire.lua)
-- ARGV[1]  the shared holder's field: "r:" .. owner id
-- ARGV[2]  this hold's release id ("r:owner#hold"; see permit_release.lua)
-- ARGV[3]  lease in milliseconds, re-applied while outer holds of the owner remain
-- ARGV[4]  the lock's channel
-- ARGV[5]  "1" on a Redis Cluster: publish with SPUBLISH (see release.lua)
-- ARGV[6]  the fencing token the hold was taken under, or "" not to check it
-- On a Redis Cluster only (see resent.lua):
-- KEYS[2]  the key's releases: instance id -> serial of its latest release of the key
-- ARGV[7]  the owner's instance id
-- ARGV[8]  this release's serial
-- ARGV[9]  how long the releases outlive their last write (the fencing counter's time)
--
-- Returns {2} when the owner's shared hold ended (and, if it was the last hold of the key,
-- the lock was freed and the release published), {1} when an outer hold of the same owner
-- remains (or this hold was already undone), {0} when the owner holds the key shared no
-- more (its lease ran out, it was deleted, or a retried final release), or holds it under
-- another token than ARGV[6].
local reply, now, mode = undo_hold(KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[6], 'token', 'mode')
if reply and reply[1] ~= 0 then
  return reply
end
-- The holder is left without a hold (or had none: an attempt undone whose copy may still
-- come, ARGV[8] its serial): a late copy of its attempts takes nothing.
local fields = not reply and redis.call('hgetall', KEYS[1]) or nil
record_holder_release(ARGV[7] and KEYS[2], ARGV[7], ARGV[8], ARGV[9], ARGV[1], fields)
if reply then
  return reply
end
forget_holder(KEYS[1], ARGV[1], fields)
local readers = redis.call('hincrby', KEYS[1], 'readers', -1)
if mode ~= 'read' then
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
