-- Frees a lock still held by the owner token and announces the release on
-- the shard channel of the key's hash slot (Redis Cluster, Redis >= 7.0).
--
-- KEYS[1]  the lock key
-- ARGV[1]  the owner token
-- ARGV[2]  the release channel of KEYS[1]'s slot; the message is KEYS[1]
--
-- SPUBLISH reaches the subscribers of the shard that owns the slot only,
-- where classic PUBLISH is broadcast to every node of the cluster. The
-- channel's hash tag puts it in the key's slot, as a script may only touch
-- its own slot.
--
-- The companion keeps the expiry its lock's acquisition or last extension
-- gave it: at least the idle period after this release (see release.lua).
-- A companion that expires is lost, and a lost companion cannot make
-- tokens go back: each token is at least the server clock in microseconds
-- (see acquire.lua).
--
-- (pcall: a key of another type, as a client that keeps its locks in a hash
-- makes, is another owner's lock, not an error.)
--
-- Returns 1 when released, 0 when the key was not held by the owner token
-- (nothing changed, nothing published).
if redis.pcall('GET', KEYS[1]) == ARGV[1] then
    redis.call('DEL', KEYS[1])
    redis.call('SPUBLISH', ARGV[2], KEYS[1])
    return 1
end
return 0
