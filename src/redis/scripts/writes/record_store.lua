-- Store an idempotency record, only while the hold that ran the handler still holds the
-- key's lock, then leave the release to release.lua.
--
-- KEYS[1]  the lock hash (see acquire.lua): its field "token" is the token of the hold
--          in Redis
-- KEYS[2]  the record: a string, beside the lock in its hash slot
-- ARGV[1]  the fencing token of the hold that ran the handler
-- ARGV[2]  the record's retention in milliseconds
-- ARGV[3]  the record
--
-- Returns 1 when stored, 0 when the lock is no longer that hold's: gone (its lease ran
-- out, it was freed by force) or taken since by another, whose token is above every token
-- issued before it, ARGV[1] included. (A hold passed between tasks of one process in
-- memory keeps the hash's token, below the tokens of the tasks it was passed to.) Tokens
-- are below 2^53, so Lua's numbers compare them exactly.
local token = redis.call('hget', KEYS[1], 'token')
if not token or tonumber(token) > tonumber(ARGV[1]) then
  return 0
end
redis.call('set', KEYS[2], ARGV[3], 'px', ARGV[2])
return 1
