-- Takes the lock and draws its fencing token, atomically.
--
-- KEYS[1]  the lock key
-- KEYS[2]  its fencing companion key (same hash slot; never expires)
-- ARGV[1]  the owner token, `<node id>/<32 hex>`
-- ARGV[2]  the ttl in milliseconds
--
-- Returns the new fencing token (>= 1) when the lock was taken, 0 when the
-- key is held by someone else.
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
    return redis.call('INCR', KEYS[2])
end
return 0
