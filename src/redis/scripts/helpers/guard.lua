-- The restart guard, shared by every script that grants a new hold (prepended by
-- scripts.rs).
--
-- Redlock's delayed restart: a server that started less than one longest lease ago may
-- have lost holds whose holders still run, so it grants no new hold until then. Its start
-- (INFO's uptime) is the marker: unlike a key it cannot survive from a stale snapshot that
-- lacks newer holds. Holds that survived are re-entered by their owners as usual.
--
-- Redis computes the uptime as the difference of two whole-second clocks (now and start,
-- each rounded down), so it may read one more than the seconds actually elapsed (started
-- at 100.9 s, it reads 1 at 101.0 s): counted one second less, never below zero, the
-- uptime is always short of the time since the start, and the wait errs long by under
-- two seconds.
--
-- restart_wait(max_lease) returns how many more milliseconds new holds must wait, or
-- nil; max_lease is the longest lease of the namespace in milliseconds, '0' when the
-- guard is off.
local function restart_wait(max_lease)
  if max_lease == '0' then
    return nil
  end
  local info = redis.call('info', 'server')
  local uptime = tonumber(string.match(info, 'uptime_in_seconds:(%d+)'))
  local wait = tonumber(max_lease) - math.max(uptime - 1, 0) * 1000
  if wait > 0 then
    return wait
  end
  return nil
end
