-- The line of waiting holders of a lock, shared by acquire.lua, release.lua and
-- withdraw.lua (prepended to each by scripts.rs).
--
-- After a run of handoffs in memory, instances take a lock in the order they began
-- waiting for it, not in a race. Two sorted sets in the lock's hash slot: `line`, holder
-- -> its place (first registration; later ones keep it), and `until`, holder -> the
-- server time in milliseconds up to which it is known to wait. A refused acquisition
-- that will wait registers (and refreshes) itself; one that takes the lock, or stops
-- waiting (withdraw.lua), leaves. A free lock goes only to the head of the line, or to
-- anyone when the line is empty; a head whose `until` is more than the grace in the past
-- (it died, or lost its connection) is dropped and the next one has its turn.
--
-- A waiter's `until` covers the sleep it will take before trying again (the holder's
-- lease, or its own wait); a release that frees the lock moves every `until` back to
-- now, since every live waiter wakes on it: so a dead waiter costs the others at most
-- the grace after a release, however long the leases are.
--
-- A release may instead grant the free lock to the live head (release.lua): the head leaves
-- the line, and the others' `until` moves to when the grant would run out unclaimed, which
-- is when they look again (line_granted).

-- The live head of the line and what is left of its turn in milliseconds, or nil when
-- nobody waits. Drops dead heads.
local function line_head(line, till, now, grace)
  while true do
    local head = redis.call('zrange', line, 0, 0)[1]
    if not head then
      return nil
    end
    local left = tonumber(redis.call('zscore', till, head) or '0') + grace - now
    if left > 0 then
      return head, left
    end
    redis.call('zrem', line, head)
    redis.call('zrem', till, head)
  end
end

-- The head's turn: nil when `holder` may take a free lock now, else how many
-- milliseconds are left of the head's turn. Drops dead heads.
local function turn_of(line, till, holder, now, grace)
  local head, left = line_head(line, till, now, grace)
  if not head or head == holder then
    return nil
  end
  return left
end

-- Registers `holder` at the end of the line (or keeps its place), known to wait for
-- `ms` more milliseconds, at most `wait`, what is left of its own wait. The line lives as
-- long as its longest wait: later registrations of a holder end no later than its first.
local function join_line(line, till, holder, now, ms, wait, grace)
  if not redis.call('zscore', line, holder) then
    local last = redis.call('zrange', line, -1, -1, 'withscores')[2]
    redis.call('zadd', line, tonumber(last or '0') + 1, holder)
    extend_lease(line, wait + grace)
    extend_lease(till, wait + grace)
  end
  redis.call('zadd', till, now + ms, holder)
end

-- Takes `holder` out of the line; returns whether it was in it.
local function leave_line(line, till, holder)
  redis.call('zrem', till, holder)
  return redis.call('zrem', line, holder) == 1
end

-- A release freed the lock while holders wait in the line: every waiter's `until` moves
-- back to now (see above).
local function wake_line(till)
  local now = now_ms()
  for _, waiter in ipairs(redis.call('zrangebyscore', till, '(' .. now, '+inf')) do
    redis.call('zadd', till, now, waiter)
  end
end

-- The same, for a caller that has not looked whether anyone waits (the clock is read only
-- when someone does: an uncontended release pays one call).
local function line_woken(till)
  if redis.call('exists', till) == 1 then
    wake_line(till)
  end
end

-- A release granted the lock to the head of the line (release.lua): the other waiters
-- are not woken, but told to look again when the grant would run out unclaimed (its
-- holder died, or never heard of it), `ms` from now; each live waiter's `until` moves
-- there, so that a dead grantee costs them at most the grant's lease and the grace.
local function line_granted(till, now, ms, grace)
  for _, waiter in ipairs(redis.call('zrangebyscore', till, '(' .. (now - grace), '+inf')) do
    redis.call('zadd', till, now + ms, waiter)
  end
end

-- Whether anyone in the line is known to wait now.
local function line_waits(till, now)
  return redis.call('zcount', till, now, '+inf') > 0
end
