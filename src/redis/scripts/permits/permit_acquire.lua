-- Take one of n permits of a semaphore, or re-enter the owner's permit (the Redisson
-- RPermitExpirableSemaphore model: every permit has its own owner, lease and token).
--
-- KEYS[1]  the semaphore hash: holder fields as holders.lua describes them (owner ->
--          re-entry count, "exp:" .. owner -> end of its lease, "tok:" .. owner -> its
--          token, the owner's attempt ids)
-- KEYS[2]  the semaphore's fencing counter
-- ARGV[1]  owner id
-- ARGV[2]  lease in milliseconds
-- ARGV[3]  how long the fencing counter outlives its last use, in milliseconds
-- ARGV[4]  the restart guard's longest lease in milliseconds, or 0 (guard.lua)
-- ARGV[5]  this attempt's id ("owner@attempt"; see acquire.lua)
-- ARGV[6]  n, the number of permits: the acquisition succeeds while fewer than n owners
--          hold one (n is the caller's, read at every acquisition, not stored)
-- On a Redis Cluster only (see resent.lua):
-- KEYS[3]  the semaphore's releases: instance id -> serial of its latest release there
-- ARGV[7]  this backend's instance id
-- ARGV[8]  this attempt's serial (the part of ARGV[5] after '@')
--
-- Returns {1, token, count} when ARGV[1] now holds a permit (count > 1: a re-entry),
-- {0, ms} when all n are taken (ms: until the earliest holder's lease ends),
-- {2, wait} when the restart guard refuses new holds for `wait` more milliseconds, or {7}
-- when a release of the instance came after this attempt: a copy sent again late, which
-- takes nothing (nor counts a re-entry), or an attempt to send again (see acquire.lua).
local kind = redis.call('type', KEYS[1])['ok']
if kind ~= 'none' and kind ~= 'hash' then
  return redis.error_reply('WRONGTYPE the semaphore key holds a ' .. kind .. ', not a semaphore hash')
end
local now = now_ms()
local mine = redis.call('hmget', KEYS[1], ARGV[1], 'exp:' .. ARGV[1], 'tok:' .. ARGV[1], ARGV[5])
local count, ends, token = tonumber(mine[1]), tonumber(mine[2]), tonumber(mine[3])
local held = count and ends and ends > now
-- A run of this same attempt took the permit already: answer as it did.
if held and mine[4] then
  return {1, token, count}
end
if released_since(ARGV[7] and KEYS[3], ARGV[7], ARGV[8]) then
  return {7}
end
if held then
  count = redis.call('hincrby', KEYS[1], ARGV[1], 1)
  redis.call('hset', KEYS[1], ARGV[5], 1)
  -- A re-entry may extend the permit's lease but never shorten it.
  lease_holder(KEYS[1], ARGV[1], now, ARGV[2], ends)
  return {1, token, count}
end

local live, earliest = prune_holders(KEYS[1], '', now)
if live >= tonumber(ARGV[6]) then
  return {0, earliest - now}
end
local wait = restart_wait(ARGV[4])
if wait then
  return {2, wait}
end
token = next_token(KEYS[2], ARGV[3])
redis.call('hset', KEYS[1], ARGV[1], 1, 'tok:' .. ARGV[1], token, ARGV[5], 1)
lease_holder(KEYS[1], ARGV[1], now, ARGV[2])
return {1, tonumber(token), 1}
