-- Take, or re-enter, a reentrant lock (the Redisson hash model).
--
-- KEYS[1]  the lock hash: owner id -> re-entry count, plus the field "token" and the ids
--          of the attempts that took holds (see ARGV[5]) and of undone re-entries (release.lua)
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
-- Returns {1, token, count} when ARGV[1] now holds the lock (count > 1: a re-entry,
-- token unchanged; also when a run of this same attempt took the hold already), {0, pttl}
-- when another owner holds it (pttl -1: no expiry set), or {2, wait} when the restart
-- guard refuses a new acquisition for `wait` more milliseconds.
local kind = redis.call('type', KEYS[1])['ok']
if kind ~= 'none' and kind ~= 'hash' then
  return redis.error_reply('WRONGTYPE the lock key holds a ' .. kind .. ', not a lock hash')
end
if kind == 'hash' then
  -- A run of this attempt took its hold already: answer as that run did, taking nothing.
  -- (The attempt's field goes with the owner's: a release that frees the lock deletes the
  -- hash, a handoff rebuilds it.)
  if redis.call('hexists', KEYS[1], ARGV[5]) == 1 then
    local held = redis.call('hmget', KEYS[1], ARGV[1], 'token')
    if held[1] then
      return {1, tonumber(held[2]), tonumber(held[1])}
    end
  end
  if redis.call('hexists', KEYS[1], ARGV[1]) == 0 then
    return {0, redis.call('pttl', KEYS[1])}
  end
  local count = redis.call('hincrby', KEYS[1], ARGV[1], 1)
  redis.call('hset', KEYS[1], ARGV[5], 1)
  -- A re-entry may extend the lease but never shorten the outer hold's.
  extend_lease(KEYS[1], ARGV[2])
  return {1, tonumber(redis.call('hget', KEYS[1], 'token')), count}
end

-- The restart guard (Redlock's delayed restart): a server that started less than one
-- longest lease ago may have lost locks whose holders still run, so it grants no new
-- acquisition until then. Its start (INFO's uptime, whole seconds rounded down, so the
-- wait errs long by under a second) is the marker: unlike a key it cannot survive from a
-- stale snapshot that lacks newer locks. Holds that survived are re-entered above.
if ARGV[4] ~= '0' then
  local info = redis.call('info', 'server')
  local uptime = tonumber(string.match(info, 'uptime_in_seconds:(%d+)'))
  local wait = tonumber(ARGV[4]) - uptime * 1000
  if wait > 0 then
    return {2, wait}
  end
end

-- A new acquisition: a new fencing token (next_token comes from token.lua).
local token = next_token(KEYS[2], ARGV[3])
redis.call('hset', KEYS[1], ARGV[1], 1, 'token', token, ARGV[5], 1)
redis.call('pexpire', KEYS[1], ARGV[2])
return {1, tonumber(token), 1}
