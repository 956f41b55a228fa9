-- Release one hold of a reentrant lock, or hand the lock to a successor in the same
-- process; idempotent per hold.
--
-- KEYS[1]  the lock hash
-- KEYS[2]  the line of holders waiting for the lock, in order (see line.lua)
-- KEYS[3]  the same holders, each with the server time up to which it is known to wait
-- KEYS[4]  the fencing counter (written by a handoff, and by a final release after holders
--          of the process took turns in memory; passed only then)
-- ARGV[1]  owner id
-- ARGV[2]  this hold's release id ("owner#hold"), written as a field of the hash when a
--          re-entry is undone, so that a retry of the same release (after a lost reply)
--          does not decrement twice
-- ARGV[3]  lease in milliseconds, re-applied while outer holds remain
-- ARGV[4]  the channel that waiters subscribe to
-- ARGV[5]  "1" on a Redis Cluster: publish on sharded pub/sub (SPUBLISH, Redis 7), so the
--          release reaches only the shard that owns ARGV[4] (KEYS[1]'s hash tag); "0" on a
--          single server, where PUBLISH keeps working on Redis before 7
--
-- The rest may be left off from the end, each then taking the value in brackets: Redis
-- turns every argument into a Lua string (about a third of a command's cost each,
-- measured), and a plain release needs none of them. The grant's come first, so that a
-- release where grants are on sends only those.
-- ARGV[6]  the grant lease in milliseconds, or "0" to grant nothing ("0"): a release that
--          frees the lock while another holder waits live in the line KEYS[2] (as turn_of
--          judges, line.lua) grants it to the line's head instead, under a new fencing
--          token (as a new acquisition gets one, from the counter that ARGV[15] settles
--          first, ARGV[9] reserved above it), for that long, and publishes "granted
--          <holder> <token> <reserved> <server ms> <lease ms>" instead of "released": the
--          head's process makes it a hold once it claimed it (a renewal, renew.lua: no
--          acquisition), and the other waiters are not woken, only told to look again when
--          the grant would run out
-- ARGV[7]  the grace the head of the line has for its turn, in milliseconds (line.lua)
-- ARGV[8]  how long the fencing counter outlives its last use, in milliseconds
-- ARGV[9]  how many tokens to reserve above a grant's or a handoff's own for the run it
--          starts ("0")
-- KEYS[4]  the fencing counter (given with ARGV[6]): written by a grant, a handoff, and a
--          final release after holders of the process took turns in memory
-- KEYS[5]  the waiting writers of the key's read/write lock (shared_acquire.lua, given with
--          KEYS[4]): a grantee registered there no longer waits
-- ARGV[10] the fencing token of the hold being released, or "" not to check it (""): a
--          release sent again after a failover (replay.rs) must act only on that very hold,
--          never on a later one of the same owner (which has a newer token; a re-entry
--          keeps it)
-- ARGV[11] "1" when an earlier call of this same release may have run (its reply was
--          lost): only then can a handoff it made exist, so only then is one looked for.
--          Always "1" on a Redis Cluster, whose client sends a call again by itself when
--          its connection drops before the reply ("0")
-- ARGV[12] the successor's owner id, or "" to release for real ("")
-- ARGV[13] the successor's lease in milliseconds
-- ARGV[14] "1" when the process's run of handoffs is used up: then the lock is released
--          for real if another holder waits in the line KEYS[2] ("0")
-- ARGV[15] the last fencing token the process issued in memory under this hold, to later
--          holders of its own (tokens up to the counter's value were reserved for that),
--          or "": a handoff's token comes next, and a final release sets the counter
--          back to it, so that tokens reserved but not issued are not skipped, and a
--          counter deleted meanwhile is restored ("")
-- KEYS[6]  on a Redis Cluster only (every argument then given): the key's releases,
--          instance id -> serial of the instance's latest release of the key, kept as
--          long as the fencing counter (ARGV[8]). Every release that leaves the owner
--          without a hold writes it, so that a copy of an earlier attempt of the instance
--          that the cluster client sends again late takes nothing (acquire.lua)
-- ARGV[16] the owner's instance id
-- ARGV[17] this release's serial: attempts and releases of one instance draw serials from
--          one counter, so every attempt sent before this release has one up to it
--
-- The grant is kept in the hash as "granted" = holder until claimed: an attempt of the
-- holder that missed the message finds it there (acquire.lua), and a waiter that gives up
-- frees it at once (withdraw.lua).
--
-- Returns {3, token} when the lock now belongs to ARGV[12] under a new fencing token (also
-- when a retry finds it already handed over), {2} when it was freed and the release
-- published, {1} when an outer hold of the same owner remains (or this hold was already
-- undone), {0} when the owner does not hold the lock (its lease ran out, it was deleted,
-- or a retried final release), or holds it under another token than ARGV[10].
local only, retried, successor = ARGV[10] or '', ARGV[11] == '1', ARGV[12] or ''
-- Kept for the instance on a cluster (KEYS[6], resent.lua).
local releases = (ARGV[16] or '') ~= '' and KEYS[6] or nil
local function mark_released()
  record_release(releases, ARGV[16], ARGV[17], ARGV[8])
end
-- One read for every case. The release id is looked for on every call: a retry sent on
-- another connection may run before the original, which must then not decrement a second
-- time. The token and the successor are read only when needed (each field read costs).
local held
if only == '' and successor == '' then
  held = redis.call('hmget', KEYS[1], ARGV[2], ARGV[1], 'readers')
else
  held = redis.call('hmget', KEYS[1], ARGV[2], ARGV[1], 'readers', 'token', successor)
end
if held[1] then
  return {1}
end
if retried and successor ~= '' and held[5] then
  mark_released()
  return {3, tonumber(held[4])}
end
local count = tonumber(held[2])
if not count or (only ~= '' and tonumber(held[4]) ~= tonumber(only)) then
  -- Also an attempt undone whose copy may still come.
  mark_released()
  return {0}
end
local issued = ARGV[15] or ''
if count > 1 then
  redis.call('hincrby', KEYS[1], ARGV[1], -1)
  redis.call('hset', KEYS[1], ARGV[2], 1)
  extend_lease(KEYS[1], ARGV[3])
  return {1}
end
local sharded = ARGV[5] == '1'
-- Freed (or turned to shared mode) after holders took turns in memory: the counter goes
-- back to the last token issued.
local function settle_counter()
  if issued ~= '' then
    redis.call('set', KEYS[4], issued, 'px', ARGV[8])
  end
end
-- The owner took shared holds of its key while holding it (a downgrade, see
-- shared_acquire.lua): they outlive this one, so the lock goes to shared mode, and new
-- shared holds and waiting writers are told.
if tonumber(held[3] or '0') > 0 then
  mark_released()
  redis.call(sharded and 'spublish' or 'publish', ARGV[4], 'released')
  forget_holder(KEYS[1], ARGV[1], redis.call('hgetall', KEYS[1]))
  redis.call('hset', KEYS[1], 'mode', 'read')
  if issued ~= '' then
    -- Shared holders see the last writer's token.
    redis.call('hset', KEYS[1], 'token', issued)
  end
  settle_counter()
  return {2}
end
if successor ~= '' and (ARGV[14] ~= '1' or not line_waits(KEYS[3], now_ms())) then
  -- The current hold's token, or the last one issued under it in memory, is the newest
  -- issued for this key (only a holder gets a new one), so the next number exceeds every
  -- earlier token without reading the clock. Checked before anything is written.
  local block = tonumber(ARGV[9] or '0')
  local last = issued ~= '' and issued or held[4]
  if last then
    last = stored_token(last, 'the token of ' .. KEYS[1], 1 + block)
  end
  mark_released()
  redis.call('del', KEYS[1])
  local token
  if last then
    token = string.format('%d', last + 1)
    redis.call('set', KEYS[4], string.format('%d', last + 1 + block), 'px', ARGV[8])
  else
    token = next_token(KEYS[4], ARGV[8], block)
    if block ~= 0 then
      redis.call('incrby', KEYS[4], block)
    end
  end
  -- The hash is rebuilt rather than edited, so the old owner's release ids go with it;
  -- a reserved block's size goes with the hold (see acquire.lua).
  if (ARGV[9] or '0') ~= '0' then
    redis.call('hset', KEYS[1], successor, 1, 'token', token, 'reserved', ARGV[9])
  else
    redis.call('hset', KEYS[1], successor, 1, 'token', token)
  end
  redis.call('pexpire', KEYS[1], ARGV[13])
  return {3, tonumber(token)}
end
-- Granted to the live head of the line (see ARGV[6]), announced before the lock is
-- written for the reason a release below publishes first.
local grant = tonumber(ARGV[6] or '0')
-- One look at the line serves the grant and the wake-up below (the line and its times
-- come and go together, line.lua).
local lined = redis.call('exists', KEYS[3]) == 1
if grant > 0 and lined then
  local now, grace = now_ms(), tonumber(ARGV[7])
  local head = line_head(KEYS[2], KEYS[3], now, grace)
  if head == ARGV[1] then
    leave_line(KEYS[2], KEYS[3], head)
    head = line_head(KEYS[2], KEYS[3], now, grace)
  end
  if head then
    -- A new token as for a new acquisition (from the counter, which a release after
    -- turns in memory first sets back to the last token issued): the hold's own may be
    -- older than a token issued in memory that this release does not know of (a
    -- re-entry's release).
    local block = tonumber(ARGV[9] or '0')
    mark_released()
    settle_counter()
    local token = next_token(KEYS[4], ARGV[8], block)
    if block ~= 0 then
      redis.call('incrby', KEYS[4], block)
    end
    redis.call(sharded and 'spublish' or 'publish', ARGV[4], string.format(
      'granted %s %s %d %d %d', head, token, block, now, grant))
    redis.call('del', KEYS[1])
    if block ~= 0 then
      redis.call('hset', KEYS[1], head, 1, 'token', token, 'granted', head, 'reserved', block)
    else
      redis.call('hset', KEYS[1], head, 1, 'token', token, 'granted', head)
    end
    redis.call('pexpire', KEYS[1], grant)
    leave_line(KEYS[2], KEYS[3], head)
    redis.call('zrem', KEYS[5], head)
    line_granted(KEYS[3], now, grant, grace)
    return {2}
  end
end
-- Published before the delete: a script that fails keeps what it did so far, so a PUBLISH
-- the ACL user may no longer send (its channel rights revoked) fails the release with the
-- lock still held, as the error then says, instead of freeing it and reporting a failure.
-- Subscribers see the message only after the script, when the lock is gone.
mark_released()
settle_counter()
redis.call(sharded and 'spublish' or 'publish', ARGV[4], 'released')
redis.call('del', KEYS[1])
if lined then
  wake_line(KEYS[3])
end
return {2}
