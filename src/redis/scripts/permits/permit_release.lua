-- Give back one hold of a semaphore permit; idempotent per hold.
--
-- KEYS[1]  the semaphore hash (see permit_acquire.lua)
-- ARGV[1]  owner id
-- ARGV[2]  this hold's release id ("owner#hold"), written when a re-entry is undone so
--          that a retry of the same release does not decrement twice
-- ARGV[3]  lease in milliseconds, re-applied while outer holds of the owner remain
-- ARGV[4]  the channel that waiters for a permit subscribe to
-- ARGV[5]  "1" on a Redis Cluster: publish with SPUBLISH (see release.lua)
-- ARGV[6]  the fencing token of the permit being released, or "" not to check it
-- On a Redis Cluster only (see resent.lua):
-- KEYS[2]  the key's releases: instance id -> serial of its latest release of the key
-- ARGV[7]  the owner's instance id
-- ARGV[8]  this release's serial
-- ARGV[9]  how long the releases outlive their last write (the fencing counter's time)
--
-- Returns {2} when the permit was freed and the release published, {1} when an outer hold
-- of the same owner remains (or this hold was already undone), {0} when the owner holds
-- no permit (its lease ran out, or a retried final release), or holds one under another
-- token than ARGV[6].
local reply = undo_hold(KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[6], 'tok:' .. ARGV[1], 'tok:' .. ARGV[1])
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
-- Published first, as release.lua does: a PUBLISH the ACL user may no longer send fails
-- the release with the permit still held, as the error says.
redis.call(ARGV[5] == '1' and 'spublish' or 'publish', ARGV[4], 'released')
forget_holder(KEYS[1], ARGV[1], fields)
if redis.call('hlen', KEYS[1]) == 0 then
  redis.call('del', KEYS[1])
end
return {2}
