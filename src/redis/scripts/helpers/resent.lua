-- Late copies on a Redis Cluster, shared by the scripts that take and give back holds
-- (prepended to each by scripts.rs).
--
-- The cluster client sends a call again by itself when its connection drops before the
-- reply, and a copy may run after the owner moved on: taking a hold then would keep the key
-- a lease with no holder. So every release of an instance records, beside the key (its
-- "releases" hash: instance id -> serial), the serial of its latest release of the key,
-- from the counter that also numbers the instance's attempts; an attempt whose serial is
-- not above it is such a copy, or was overtaken by a release sent after it (then it is
-- sent again under a new serial), and takes nothing. Off a cluster the releases hash is
-- not given (nil) and both are no-ops.

-- Whether the attempt numbered `serial` of `instance` came after a release it sent later.
local function released_since(releases, instance, serial)
  if not releases then
    return false
  end
  local last = redis.call('hget', releases, instance)
  return last ~= false and tonumber(serial) <= tonumber(last)
end

-- Records the release numbered `serial` of `instance`, never lowering the record (a release
-- may overtake another of the same instance); the hash lives `ttl` ms, as the fencing
-- counter does. Called before the lock is written: a release that this write fails (no
-- memory left, no right to the key) leaves the lock as it was.
local function record_release(releases, instance, serial, ttl)
  if not releases then
    return
  end
  local last = redis.call('hget', releases, instance)
  if not last or tonumber(last) < tonumber(serial) then
    redis.call('hset', releases, instance, serial)
  end
  redis.call('pexpire', releases, ttl)
end
