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
-- not given (nil) and these are no-ops.

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

-- Records that `holder` gave back its last hold of a key that several owners hold at once
-- (shared holds, permits), under the serial of its latest attempt that took a hold
-- (its fields `holder@serial` among `fields`, the hash's HGETALL, holders.lua) rather
-- than the release's own `serial`: every attempt of the holder whose copy may still come
-- is at most that, and a release of one holder then refuses only the attempts of the
-- instance's other holders sent after that attempt, not every attempt still on its way
-- (the cluster client does not keep one connection's calls in the order they were made:
-- of 800 shared holds taken by 16 tasks of one instance at once, 277-337 were sent again
-- with the release's own serial recorded, 0-2 with this; tests/it/cluster/late_resend.rs).
-- `fields` nil, or no such field: `serial`.
local function record_holder_release(releases, instance, serial, ttl, holder, fields)
  if not releases then
    return
  end
  local at, latest = holder .. '@', nil
  for i = 1, #(fields or {}), 2 do
    local f = fields[i]
    if string.sub(f, 1, #at) == at then
      local n = tonumber(string.sub(f, #at + 1))
      if n and (not latest or n > latest) then
        latest = n
      end
    end
  end
  record_release(releases, instance, latest and string.format('%d', latest) or serial, ttl)
end
