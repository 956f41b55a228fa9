-- Take, or re-enter, a reentrant lock (the Redisson hash model).
--
-- KEYS[1]  the lock hash: owner id -> re-entry count, plus the field "token"
-- KEYS[2]  the fencing counter: a string holding the last token issued for KEYS[1]
-- ARGV[1]  owner id ("instance-uuid:request-seq")
-- ARGV[2]  lease in milliseconds
-- ARGV[3]  how long the fencing counter outlives its last use, in milliseconds
--
-- Returns {1, token, count} when ARGV[1] now holds the lock (count > 1: a re-entry,
-- token unchanged), or {0, pttl} when another owner holds it (pttl -1: no expiry set).
local kind = redis.call('type', KEYS[1])['ok']
if kind ~= 'none' and kind ~= 'hash' then
  return redis.error_reply('WRONGTYPE the lock key holds a ' .. kind .. ', not a lock hash')
end
if kind == 'hash' then
  if redis.call('hexists', KEYS[1], ARGV[1]) == 0 then
    return {0, redis.call('pttl', KEYS[1])}
  end
  local count = redis.call('hincrby', KEYS[1], ARGV[1], 1)
  -- A re-entry may extend the lease but never shorten the outer hold's.
  extend_lease(KEYS[1], ARGV[2])
  return {1, tonumber(redis.call('hget', KEYS[1], 'token')), count}
end

-- A new acquisition: a new fencing token (next_token comes from token.lua).
local token = next_token(KEYS[2], ARGV[3])
redis.call('hset', KEYS[1], ARGV[1], 1, 'token', token)
redis.call('pexpire', KEYS[1], ARGV[2])
return {1, tonumber(token), 1}
