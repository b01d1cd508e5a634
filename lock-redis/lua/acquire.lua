-- Takes one lock and draws its fencing token, atomically (see fencing.lua).
--
-- KEYS[1]  the lock key
-- KEYS[2]  its fencing companion key (same hash slot; never expires)
-- ARGV[1]  the owner token, `<node id>/<32 hex>`
-- ARGV[2]  the ttl in milliseconds
return acquire(KEYS[1], KEYS[2], ARGV[1], ARGV[2])
