-- Release one hold of a reentrant lock, or hand the lock to a successor in the same
-- process; idempotent per hold.
--
-- KEYS[1]  the lock hash
-- KEYS[2]  the fencing counter (written only by a handoff)
-- ARGV[1]  owner id
-- ARGV[2]  this hold's release id ("owner#hold"), written as a field of the hash when a
--          re-entry is undone, so that a retry of the same release (after a lost reply)
--          does not decrement twice
-- ARGV[3]  lease in milliseconds, re-applied while outer holds remain
-- ARGV[4]  the channel that waiters subscribe to
-- ARGV[5]  the successor's owner id, or "" to release for real
-- ARGV[6]  the successor's lease in milliseconds
-- ARGV[7]  how long the fencing counter outlives its last use, in milliseconds
-- ARGV[8]  "1" when the process's run of handoffs is used up: then the lock is released
--          for real if anyone (another instance) is subscribed to ARGV[4]
-- ARGV[9]  "1" when an earlier call of this same release may have run (its reply was
--          lost): only then can a handoff it made exist, so only then is one looked for.
--          Always "1" on a Redis Cluster, whose client sends a call again by itself when
--          its connection drops before the reply
-- ARGV[10] "1" on a Redis Cluster: publish on sharded pub/sub (SPUBLISH, Redis 7), so the
--          release reaches only the shard that owns ARGV[4] (KEYS[1]'s hash tag); "0" on a
--          single server, where PUBLISH keeps working on Redis before 7
-- ARGV[11] the fencing token of the hold being released, or "" not to check it: a release
--          sent again after a failover (replay.rs) must act only on that very hold, never
--          on a later one of the same owner (which has a newer token; a re-entry keeps it)
--
-- Returns {3, token} when the lock now belongs to ARGV[5] under a new fencing token (also
-- when a retry finds it already handed over), {2} when it was freed and the release
-- published, {1} when an outer hold of the same owner remains (or this hold was already
-- undone), {0} when the owner does not hold the lock (its lease ran out, it was deleted,
-- or a retried final release), or holds it under another token than ARGV[11].
-- The release id is looked for on every call: a retry sent on another connection may run
-- before the original, which must then not decrement a second time.
if redis.call('hexists', KEYS[1], ARGV[2]) == 1 then
  return {1}
end
if ARGV[9] == '1' and ARGV[5] ~= '' and redis.call('hexists', KEYS[1], ARGV[5]) == 1 then
  return {3, tonumber(redis.call('hget', KEYS[1], 'token'))}
end
local held = redis.call('hmget', KEYS[1], ARGV[1], 'token', 'readers')
local count = tonumber(held[1])
local only = ARGV[11] or ''
if not count or (only ~= '' and tonumber(held[2]) ~= tonumber(only)) then
  return {0}
end
if count > 1 then
  redis.call('hincrby', KEYS[1], ARGV[1], -1)
  redis.call('hset', KEYS[1], ARGV[2], 1)
  extend_lease(KEYS[1], ARGV[3])
  return {1}
end
local sharded = ARGV[10] == '1'
-- The owner took shared holds of its key while holding it (a downgrade, see
-- shared_acquire.lua): they outlive this one, so the lock goes to shared mode, and new
-- shared holds and waiting writers are told.
if tonumber(held[3] or '0') > 0 then
  redis.call(sharded and 'spublish' or 'publish', ARGV[4], 'released')
  forget_holder(KEYS[1], ARGV[1], redis.call('hgetall', KEYS[1]))
  redis.call('hset', KEYS[1], 'mode', 'read')
  return {2}
end
local function subscribers(channel)
  return redis.call('pubsub', sharded and 'shardnumsub' or 'numsub', channel)[2]
end
if ARGV[5] ~= '' and (ARGV[8] ~= '1' or subscribers(ARGV[4]) == 0) then
  redis.call('del', KEYS[1])
  -- The current hold's token is the newest issued for this key (only a holder gets a new
  -- one), so the next number exceeds every earlier token without reading the clock.
  local last = tonumber(held[2])
  local token
  if last then
    token = string.format('%.0f', last + 1)
    redis.call('set', KEYS[2], token, 'px', ARGV[7])
  else
    token = next_token(KEYS[2], ARGV[7])
  end
  -- The hash is rebuilt rather than edited, so the old owner's release ids go with it.
  redis.call('hset', KEYS[1], ARGV[5], 1, 'token', token)
  redis.call('pexpire', KEYS[1], ARGV[6])
  return {3, tonumber(token)}
end
-- Published before the delete: a script that fails keeps what it did so far, so a PUBLISH
-- the ACL user may no longer send (its channel rights revoked) fails the release with the
-- lock still held, as the error then says, instead of freeing it and reporting a failure.
-- Subscribers see the message only after the script, when the lock is gone.
redis.call(sharded and 'spublish' or 'publish', ARGV[4], 'released')
redis.call('del', KEYS[1])
return {2}
