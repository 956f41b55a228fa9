-- Free a key's lock or semaphore whatever holds it (an operator's force-release), fenced.
--
-- KEYS[1]  the lock hash, or the semaphore hash
-- KEYS[2]  its fencing counter
-- ARGV[1]  "1" for the semaphore (permit_acquire.lua), "0" for the lock
-- ARGV[2]  the channel its waiters subscribe to
-- ARGV[3]  "1" on a Redis Cluster: publish with SPUBLISH (see release.lua)
-- ARGV[4]  how long the fencing counter outlives its last use, in milliseconds
-- On a Redis Cluster only:
-- KEYS[3]  the key's releases (resent.lua), where the field "forced:" .. ARGV[5] keeps the
--          instance's latest force-release of the key: "serial mode holders holds lease
--          token", as long as the fencing counter
-- ARGV[5]  the operator's backend's instance id
-- ARGV[6]  this call's serial, from a counter of that backend's force-releases
--
-- Returns the snapshot of what was freed (snapshot.lua), or WRONGTYPE when KEYS[1] is not
-- a hash (not a lock: left alone).
--
-- On a cluster, the client sends a call again by itself when its connection drops before
-- the reply, and a copy may run after the key was freed and taken again: it must not free
-- that later hold. So one call frees at most once: a copy of the call that freed (ARGV[6]
-- recorded) answers as that run did and frees nothing, and a copy of an earlier call of
-- the instance (a later one recorded) frees nothing and reports the key free.
--
-- The holders' fields go with the hash, so their renewals (renew.lua) and releases find
-- nothing: they are lost. The counter is set to the snapshot's token, the highest issued
-- or reserved, which is never below its own value: the next holder's token (token.lua) is
-- above every earlier one, also those a process issues in memory from a reserved block,
-- whose top the counter may no longer hold (deleted meanwhile). Waiting writers stay
-- registered (KEYS[1]:writers): they still wait.
local forced = ARGV[5] and 'forced:' .. ARGV[5]
if forced then
  local last = redis.call('hget', KEYS[3], forced)
  if last then
    local run = {}
    for n in string.gmatch(last, '%S+') do
      run[#run + 1] = tonumber(n)
    end
    local serial = tonumber(ARGV[6])
    if serial == run[1] then
      return {run[2], run[3], run[4], run[5], run[6]}
    elseif serial < run[1] then
      return {0, 0, 0, -1, 0}
    end
  end
end
local info, refused = snapshot(KEYS[1], KEYS[2], ARGV[1] == '1')
if not info then
  return refused
end
-- Recorded also when nothing is held (a copy must not free a hold taken after this call),
-- and before the key is freed, for the reason release.lua records first.
local function record()
  if forced then
    local run = {ARGV[6]}
    for i = 1, #info do
      run[#run + 1] = string.format('%d', info[i])
    end
    redis.call('hset', KEYS[3], forced, table.concat(run, ' '))
    redis.call('pexpire', KEYS[3], ARGV[4])
  end
end
if redis.call('exists', KEYS[1]) == 0 then
  record()
  return info
end
-- Published first, as release.lua does: a PUBLISH the ACL user may not send fails the
-- call with the key still held.
redis.call(ARGV[3] == '1' and 'spublish' or 'publish', ARGV[2], 'released')
record()
if info[5] > 0 then
  local ttl = math.max(redis.call('pttl', KEYS[2]), tonumber(ARGV[4]))
  redis.call('set', KEYS[2], string.format('%d', info[5]), 'px', ttl)
end
redis.call('del', KEYS[1])
return info
