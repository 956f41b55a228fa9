-- Take, or re-enter, a shared (read) hold of a read/write lock.
--
-- The lock hash is the one acquire.lua takes exclusively. Shared holders are fields
-- "r:" .. owner -> re-entry count, each with its own lease ("exp:r:" .. owner, see
-- holders.lua), and the hash then carries "mode" = "read" while no owner holds it
-- exclusively, "readers" = how many owners hold it shared, and "token" = the fencing
-- token of the key's last exclusive acquisition. A writer that holds the key may take
-- shared holds of it too (a downgrade): its shared hold outlives its exclusive one.
--
-- KEYS[1]  the lock hash
-- KEYS[2]  the fencing counter (read, never written: shared holds get no token of their own)
-- KEYS[3]  the waiting writers: a sorted set owner -> end of that writer's wait
--          (written by acquire.lua); while one is waiting, new shared holds queue
--          behind it, so a stream of readers cannot starve it
-- ARGV[1]  the shared holder's field: "r:" .. owner id
-- ARGV[2]  lease in milliseconds
-- ARGV[3]  the restart guard's longest lease in milliseconds, or 0 (guard.lua)
-- ARGV[4]  this attempt's id ("r:owner@attempt"; see acquire.lua)
-- ARGV[5]  owner id (to recognise a writer taking a shared hold of its own key)
-- On a Redis Cluster only (see resent.lua):
-- KEYS[4]  the key's releases: instance id -> serial of its latest release of the key
-- ARGV[6]  this backend's instance id
-- ARGV[7]  this attempt's serial (the part of ARGV[4] after '@')
--
-- Returns {1, token, count} when the owner now holds the key shared (count > 1: a
-- re-entry), {0, ms} when a writer holds it or waits for it (ms: the writer's lease or
-- wait, -1 unknown), {2, wait} when the restart guard refuses new holds, or {7} when a
-- release of the instance came after this attempt: a copy sent again late, which takes
-- nothing (nor counts a re-entry), or an attempt to send again (see acquire.lua).
local kind = redis.call('type', KEYS[1])['ok']
if kind ~= 'none' and kind ~= 'hash' then
  return redis.error_reply('WRONGTYPE the lock key holds a ' .. kind .. ', not a lock hash')
end
local now = now_ms()
local releases = ARGV[6] and KEYS[4]

-- The reply that keeps a new shared holder out, or nil: new readers queue behind a
-- waiting writer, and wait out the restart guard.
local function kept_out(at)
  local writer = redis.call('zrangebyscore', KEYS[3], '(' .. at, '+inf', 'withscores', 'limit', 0, 1)
  if writer[1] then
    return {0, tonumber(writer[2]) - at}
  end
  local wait = restart_wait(ARGV[3])
  if wait then
    return {2, wait}
  end
  return nil
end

if kind == 'hash' then
  local held = redis.call('hmget', KEYS[1], ARGV[1], ARGV[4], 'token', 'mode', ARGV[5], 'exp:' .. ARGV[1])
  local token = tonumber(held[3]) or 0
  local ends = tonumber(held[6])
  -- (A shared hold whose own lease ran out is not re-entered: it is pruned below.)
  local live = held[1] and ends and ends > now
  -- A run of this same attempt took the hold already: answer as it did.
  if live and held[2] then
    return {1, token, tonumber(held[1])}
  end
  if released_since(releases, ARGV[6], ARGV[7]) then
    return {7}
  end
  if live then
    local count = redis.call('hincrby', KEYS[1], ARGV[1], 1)
    redis.call('hset', KEYS[1], ARGV[4], 1)
    lease_holder(KEYS[1], ARGV[1], now, ARGV[2], ends)
    return {1, token, count}
  end
  if held[1] then
    -- Its lease ran out while the hash lived on: taken afresh below.
    forget_holder(KEYS[1], ARGV[1], redis.call('hgetall', KEYS[1]))
    redis.call('hincrby', KEYS[1], 'readers', -1)
  end
  if held[4] ~= 'read' then
    if not held[5] then
      return {0, redis.call('pttl', KEYS[1])}
    end
    -- The writer itself: a downgrade, let in whoever waits.
  else
    -- (A hash that survived a restart may lack a writer's newer hold: the guard applies.)
    local refused = kept_out(now)
    if refused then
      return refused
    end
  end
  redis.call('hset', KEYS[1], ARGV[1], 1, ARGV[4], 1)
  redis.call('hincrby', KEYS[1], 'readers', 1)
  lease_holder(KEYS[1], ARGV[1], now, ARGV[2])
  return {1, token, 1}
end

if released_since(releases, ARGV[6], ARGV[7]) then
  return {7}
end
local refused = kept_out(now)
if refused then
  return refused
end
-- The last exclusive acquisition's token is the counter's value (only a writer moves it).
local token = redis.call('get', KEYS[2]) or '0'
redis.call('hset', KEYS[1], 'mode', 'read', 'readers', 1, 'token', token, ARGV[1], 1, ARGV[4], 1)
lease_holder(KEYS[1], ARGV[1], now, ARGV[2])
return {1, tonumber(token), 1}
