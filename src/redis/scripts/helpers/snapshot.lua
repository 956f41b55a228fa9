-- A snapshot of one key's lock or semaphore, for the operator's scripts (inspect.lua,
-- force_release.lua; prepended to each by scripts.rs, after holders.lua).
--
-- snapshot(hash, counter, semaphore) reads the lock hash (acquire.lua, shared_acquire.lua)
-- or, when `semaphore`, the semaphore hash (permit_acquire.lua), and its fencing counter.
-- Returns {mode, holders, holds, lease, token}:
--   mode     0 free, 1 held exclusively, 2 held shared, 3 permits taken
--   holders  how many owners hold it (a holder whose own lease ended is not counted)
--   holds    their holds, re-entries included
--   lease    milliseconds the longest of their leases still runs, -1 when free
--   token    the highest fencing token issued or reserved for the key that is remembered,
--            0 when none is: the counter, the hold's token and the block reserved above it
--            for holders that get the lock in memory ("reserved", acquire.lua), and the
--            permits' own tokens
-- or nil and an error reply when the key holds something other than a hash. Owner ids
-- are never returned: they are what a holder proves itself with.
local function snapshot(hash, counter, semaphore)
  local kind = redis.call('type', hash)['ok']
  if kind ~= 'none' and kind ~= 'hash' then
    return nil, redis.error_reply('WRONGTYPE the key holds a ' .. kind .. ', not a lock hash')
  end
  local fields = redis.call('hgetall', hash)
  local t = {}
  for i = 1, #fields, 2 do
    t[fields[i]] = fields[i + 1]
  end
  local token = tonumber(redis.call('get', counter) or '0') or 0
  local function above(n)
    if n and n > token then
      token = n
    end
  end
  above(tonumber(t.token or '0'))
  if t.token and t.reserved then
    above(tonumber(t.token) + tonumber(t.reserved))
  end
  local mode, holders, holds, lease = 0, 0, 0, -1
  if semaphore or t.mode == 'read' then
    -- Holders with a lease of their own (holders.lua): "exp:" .. holder.
    local prefix = semaphore and 'exp:' or 'exp:r:'
    local now = now_ms()
    for f, ends in pairs(t) do
      if string.sub(f, 1, #prefix) == prefix then
        local holder = string.sub(f, 5)
        above(tonumber(t['tok:' .. holder] or '0'))
        local left = tonumber(ends) - now
        if left > 0 then
          holders = holders + 1
          holds = holds + (tonumber(t[holder]) or 0)
          lease = math.max(lease, left)
        end
      end
    end
    if holders > 0 then
      mode = semaphore and 3 or 2
    end
  else
    -- The exclusive holder: the field named by an owner id ("instance-uuid:sequence");
    -- the others are the token, attempt and release ids (with '@', '#') and, after a
    -- downgrade, the owner's shared hold ("r:" ...).
    for f, count in pairs(t) do
      if string.match(f, '^%x+:%d+$') then
        holders = holders + 1
        holds = holds + tonumber(count)
      end
    end
    if holders > 0 then
      mode = 1
      lease = redis.call('pttl', hash)
    end
  end
  return {mode, holders, holds, lease, token}
end
