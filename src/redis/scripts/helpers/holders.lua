-- Holders with their own lease, shared by the scripts of shared holds and semaphores (and
-- acquire.lua, which meets shared holds; prepended to each by scripts.rs).
--
-- A key that several owners hold at once (a read/write lock in shared mode, a semaphore)
-- cannot live by one PEXPIRE alone: a holder that crashed would keep its place as long as
-- the others renew. So each such holder has its own expiry in the hash, the field
-- "exp:" .. holder -> server time in milliseconds when its lease ends (renew.lua moves it),
-- and the key's PEXPIRE is only the latest of them. The other fields of a holder are
-- the holder itself (its count), "tok:" .. holder (its fencing token, semaphores), and
-- the ids of its acquisition attempts (holder .. "@n") and undone re-entries
-- (holder .. "#n"). Owner ids are lower-case hex, ':' and digits, so no holder starts
-- with "exp:" or "tok:".

-- The server clock in milliseconds.
local function now_ms()
  local t = redis.call('time')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Deletes every field of `holder` from `key`.
local function forget_holder(key, holder, fields)
  local doomed = {holder, 'exp:' .. holder, 'tok:' .. holder}
  local at, hash = holder .. '@', holder .. '#'
  for i = 1, #fields, 2 do
    local f = fields[i]
    local head = string.sub(f, 1, #at)
    if head == at or head == hash then
      doomed[#doomed + 1] = f
    end
  end
  redis.call('hdel', key, unpack(doomed))
end

-- Drops the holders of `key` whose names start with `prefix` and whose own lease ended
-- before `now`. Returns how many such holders are left, and the earliest end of their
-- leases (nil when none is left).
local function prune_holders(key, prefix, now)
  local fields = redis.call('hgetall', key)
  local live, earliest, gone = 0, nil, {}
  local tag = 'exp:' .. prefix
  for i = 1, #fields, 2 do
    local f = fields[i]
    if string.sub(f, 1, #tag) == tag then
      local ends = tonumber(fields[i + 1])
      if ends <= now then
        gone[#gone + 1] = string.sub(f, 5)
      else
        live = live + 1
        if not earliest or ends < earliest then
          earliest = ends
        end
      end
    end
  end
  for _, holder in ipairs(gone) do
    forget_holder(key, holder, fields)
  end
  return live, earliest
end

-- Makes `holder`'s own lease (now ending at `ends`, nil for a new holder) run at least
-- `ms` from `now`, never shortening it (as extend_lease, from lease.lua, does for the
-- key, which it also keeps alive at least that long).
local function lease_holder(key, holder, now, ms, ends)
  local wanted = now + tonumber(ms)
  if not ends or ends < wanted then
    redis.call('hset', key, 'exp:' .. holder, string.format('%d', wanted))
  end
  extend_lease(key, ms)
end

-- The common start of giving back one hold of `holder` (shared_release.lua,
-- permit_release.lua), idempotent per hold through `release_id`. Returns the script's
-- reply when it ends here: {1} when this hold was already undone or an outer hold of the
-- holder remains (its lease re-applied, `lease` ms), {0} when the holder holds nothing
-- (its own lease ran out, or a retried final release) or holds it under another token
-- than `token` (read from `token_field`; '' not to check). Otherwise this is the holder's
-- last hold, for the caller to give up: returns nil, the time, and the value of `field`.
local function undo_hold(key, holder, release_id, lease, token, token_field, field)
  if redis.call('hexists', key, release_id) == 1 then
    return {1}
  end
  local now = now_ms()
  local held = redis.call('hmget', key, holder, 'exp:' .. holder, token_field, field)
  local count, ends = tonumber(held[1]), tonumber(held[2])
  if not count or not ends or ends <= now or (token ~= '' and tonumber(held[3]) ~= tonumber(token)) then
    return {0}
  end
  if count > 1 then
    redis.call('hincrby', key, holder, -1)
    redis.call('hset', key, release_id, 1)
    lease_holder(key, holder, now, lease, ends)
    return {1}
  end
  return nil, now, held[4]
end
