-- Take, or re-enter, a reentrant lock (the Redisson hash model).
--
-- KEYS[1]  the lock hash: owner id -> re-entry count, plus the field "token" and the ids
--          of the attempts that took holds (see ARGV[5]) and of undone re-entries
--          (release.lua), and "reserved" = ARGV[8] when tokens were reserved
-- KEYS[2]  the fencing counter: a string holding the last token issued for KEYS[1]
-- ARGV[1]  owner id ("instance-uuid:request-seq")
-- ARGV[2]  lease in milliseconds
-- ARGV[3]  how long the fencing counter outlives its last use, in milliseconds
-- ARGV[4]  the restart guard: the longest lease of the namespace in milliseconds, or 0
--          when the guard is off
-- ARGV[5]  this attempt's id ("owner@attempt"), written as a field of the hash by the run
--          that takes the hold: a cluster client sends a call again when its connection
--          drops before the reply, and the second run of one attempt must not count a
--          second hold
--
-- KEYS[3]  the waiting writers of the key's read/write lock (see shared_acquire.lua)
-- ARGV[6]  how long this acquisition still waits, in milliseconds, or 0 when it does not
--          wait: a waiting writer kept out by shared holders registers in KEYS[3] for that
--          long, so that new shared holds queue behind it
-- KEYS[4]  the line of holders waiting for the lock, in order (see line.lua)
-- KEYS[5]  the same holders, each with the server time up to which it is known to wait
-- ARGV[7]  the grace in milliseconds that the head of the line has to take its turn
--          (see line.lua), or "0" to keep no line (a quorum's masters: each would line
--          waiters up in its own order, and no order might win a majority)
-- ARGV[8]  how many fencing tokens to reserve above a new acquisition's own, for later
--          holders of the same process that get the lock in memory (may be left off: 0)
-- The rest is given on a Redis Cluster only (ARGV[8] then given too); without it the
-- record below is KEYS[6]:
-- KEYS[6]  the key's releases: instance id -> the serial of the instance's latest release
--          of the key (release.lua), kept as long as the fencing counter
-- ARGV[9]  this backend's instance id (the part of ARGV[1] before its last ':')
-- ARGV[10] this attempt's serial (the part of ARGV[5] after '@'): attempts and releases
--          of one instance draw their serials from one counter, so a copy of this attempt
--          that the cluster client sends again after a release of its instance has a
--          serial up to that release's, and takes nothing (its owner moved on: a hold taken
--          then would stay a lease with no holder)
--
-- KEYS[6], on a Redis Cluster KEYS[7]  (may be left off) the key's idempotency record
--          (record_store.lua), for an acquisition of the idempotency layer: while it
--          exists, no new hold is taken
--
-- Returns {1, token, count} when ARGV[1] now holds the lock (count > 1: a re-entry,
-- token unchanged; also when a run of this same attempt took the hold already), {0, pttl}
-- when another owner holds it (pttl -1: no expiry set), or {2, wait} when the restart
-- guard refuses a new acquisition for `wait` more milliseconds (guard.lua), {0, pttl, 1}
-- when held shared and this acquisition registered as a waiting writer (pttl: until the
-- first shared holder's own lease ends; also when refused and registered in the line of
-- waiting holders, the lock held or free for the head's turn), {0, pttl, 1, now} when
-- it registered in that line (now: the server's clock in milliseconds, against which the
-- holder times a grant it is sent, see release.lua), {8, token, pttl, reserved} when a
-- release granted the lock to ARGV[1] and it was not claimed yet, {4} when the
-- owner holds the key shared (a shared hold cannot be upgraded: two readers doing so
-- would wait for each other forever), or {6} when the record exists and the attempt would
-- take a new hold: it takes nothing, and leaves the waiting writers and the line, or {7}
-- when a release of the instance came after this attempt (ARGV[10]): the same.
local kind = redis.call('type', KEYS[1])['ok']
if kind ~= 'none' and kind ~= 'hash' then
  return redis.error_reply('WRONGTYPE the lock key holds a ' .. kind .. ', not a lock hash')
end
local releases, record = nil, KEYS[6]
if ARGV[9] then
  releases, record = KEYS[6], KEYS[7]
end
local held
if kind == 'hash' then
  -- One read for every case below.
  held = redis.call('hmget', KEYS[1], ARGV[5], ARGV[1], 'token', 'mode', 'r:' .. ARGV[1],
    'exp:r:' .. ARGV[1], 'granted')
  -- A run of this attempt took its hold already: answer as that run did, taking nothing.
  -- (The attempt's field goes with the owner's: a release that frees the lock deletes the
  -- hash, a handoff rebuilds it.)
  if held[1] and held[2] then
    return {1, tonumber(held[3]), tonumber(held[2])}
  end
  -- A release granted the lock to this holder (release.lua), which has not claimed it:
  -- the acquisition that waited missed the message (or this is a re-entry of the hold it
  -- made of it, before its first renewal claimed it). Nothing is written: the core
  -- takes the grant, or claims it before it re-enters.
  if held[2] and held[7] == ARGV[1] then
    return {8, tonumber(held[3]), redis.call('pttl', KEYS[1]),
      tonumber(redis.call('hget', KEYS[1], 'reserved') or '0')}
  end
  if held[2] then
    -- A copy of a re-entry sent again late (see below), after the owner released that
    -- hold or gave the attempt up: its owner may hold the key again, under a hold this
    -- attempt never made, and no one would give back the count it added.
    if released_since(releases, ARGV[9], ARGV[10]) then
      return {7}
    end
    local count = redis.call('hincrby', KEYS[1], ARGV[1], 1)
    redis.call('hset', KEYS[1], ARGV[5], 1)
    -- A re-entry may extend the lease but never shorten the outer hold's.
    extend_lease(KEYS[1], ARGV[2])
    return {1, tonumber(held[3]), count}
  end
end

-- An attempt that takes nothing leaves the waiting writers and the line.
local function withdraw()
  if ARGV[6] ~= '0' then
    redis.call('zrem', KEYS[3], ARGV[1])
    if ARGV[7] ~= '0' then
      leave_line(KEYS[4], KEYS[5], ARGV[1])
    end
  end
end

-- A copy of an attempt sent again late by the cluster client, after its owner gave it up
-- or released the hold it took: no one would release what it takes (nor wait in the line
-- for it). Checked before the lock's state, so that a copy that finds the lock held
-- leaves no waiter behind either. An attempt that is no copy but was overtaken by such a
-- release (sent just before it) gets the same answer, and the core tries again at once.
if released_since(releases, ARGV[9], ARGV[10]) then
  withdraw()
  return {7}
end

-- The idempotency layer's request whose key has a record is a retry of a completed one:
-- it is replayed, and takes no hold (the holder that stored the record did so before
-- releasing, so a hold taken here with no record cannot miss one stored before it).
-- A waiter that leaves the line this way wakes nobody: every waiter was woken by the
-- release that followed the record, and one that checks no record waits for a head's
-- turn at most the grace.
if record and redis.call('exists', record) == 1 then
  withdraw()
  return {6}
end

if kind == 'hash' then
  -- Held by others: exclusively, or shared (shared_acquire.lua).
  local now = held[5] and now_ms()
  -- (A shared hold of this owner whose own lease ran out is pruned below, not refused.)
  if held[5] and tonumber(held[6] or '0') > now then
    return {4}
  end
  if held[4] ~= 'read' then
    local pttl = redis.call('pttl', KEYS[1])
    if ARGV[6] ~= '0' and ARGV[7] ~= '0' then
      -- Known to wait until the holder's lease ends (it tries again then) or its own wait.
      local ms = tonumber(ARGV[6])
      if pttl >= 0 and pttl < ms then
        ms = pttl
      end
      now = now_ms()
      join_line(KEYS[4], KEYS[5], ARGV[1], now, ms, tonumber(ARGV[6]), tonumber(ARGV[7]))
      return {0, pttl, 1, now}
    end
    return {0, pttl}
  end
  now = now or now_ms()
  local live, earliest = prune_holders(KEYS[1], 'r:', now)
  if live > 0 then
    if ARGV[6] == '0' then
      return {0, redis.call('pttl', KEYS[1])}
    end
    -- Registered until its wait ends; past registrations (writers that crashed) go.
    redis.call('zremrangebyscore', KEYS[3], '-inf', now)
    redis.call('zadd', KEYS[3], now + tonumber(ARGV[6]), ARGV[1])
    extend_lease(KEYS[3], ARGV[6])
    if ARGV[7] ~= '0' then
      local wait = tonumber(ARGV[6])
      join_line(KEYS[4], KEYS[5], ARGV[1], now, math.min(wait, earliest - now), wait,
        tonumber(ARGV[7]))
    end
    -- Woken when the first shared lease ends, if no release comes before: a crashed
    -- reader keeps the writer out no longer than its own lease.
    return {0, earliest - now, 1, now}
  end
  -- Every shared holder's lease ran out (they crashed): the lock is free.
  redis.call('del', KEYS[1])
end

-- Free: the head of the line's, if anyone waits in it.
local lined = ARGV[7] ~= '0' and redis.call('exists', KEYS[4]) == 1
if lined then
  local now, grace = now_ms(), tonumber(ARGV[7])
  local left = turn_of(KEYS[4], KEYS[5], ARGV[1], now, grace)
  if left then
    if ARGV[6] == '0' then
      return {0, left}
    end
    -- It tries again when the head's turn is over, unless woken before.
    local wait = tonumber(ARGV[6])
    join_line(KEYS[4], KEYS[5], ARGV[1], now, math.min(wait, left), wait, grace)
    return {0, left, 1, now}
  end
end

local wait = restart_wait(ARGV[4])
if wait then
  return {2, wait}
end

-- A new acquisition: a new fencing token (next_token comes from token.lua).
local token = next_token(KEYS[2], ARGV[3], ARGV[8])
if ARGV[8] and ARGV[8] ~= '0' then
  redis.call('incrby', KEYS[2], ARGV[8])
  -- The block's size goes with the hold, so that a force-release fences above it even if
  -- the counter is gone by then (snapshot.lua).
  redis.call('hset', KEYS[1], ARGV[1], 1, 'token', token, ARGV[5], 1, 'reserved', ARGV[8])
else
  redis.call('hset', KEYS[1], ARGV[1], 1, 'token', token, ARGV[5], 1)
end
redis.call('pexpire', KEYS[1], ARGV[2])
-- A waiting acquisition may have registered as a waiting writer in an earlier attempt
-- (or an earlier run of this one, sent again by a cluster client): it waits no more.
if ARGV[6] ~= '0' then
  redis.call('zrem', KEYS[3], ARGV[1])
end
-- Its turn is taken.
if lined then
  leave_line(KEYS[4], KEYS[5], ARGV[1])
end
return {1, tonumber(token), 1}
