-- Frees a lock still held by the owner token and announces the release,
-- without the fair queue: the release of a user whose ACL does not reach
-- the queue's keys [F6] (release.lua otherwise).
--
-- KEYS[1]  the lock key
-- ARGV[1]  the owner token
-- ARGV[2]  the release channel; the message is the lock key (KEYS[1])
--
-- The companion keeps the expiry its lock's acquisition or last extension
-- gave it, the lock's ttl plus the idle period from then
-- (RedisConfig::fence_idle): since the lock was still held, that is at
-- least the idle period after this release, and at most the ttl more.
-- (Setting it here cost a command and a replicated write per release, 8%
-- of a lock cycle's server instructions.) A companion that expires is
-- lost, and a lost companion cannot make tokens go back: each token is at
-- least the server clock in microseconds (see acquire.lua).
--
-- (pcall: a key of another type, as a client that keeps its locks in a hash
-- makes, is another owner's lock, not an error.)
--
-- Returns 1 when released, 0 when the key was not held by the owner token
-- (nothing changed, nothing published).
if redis.pcall('GET', KEYS[1]) == ARGV[1] then
    redis.call('DEL', KEYS[1])
    redis.call('PUBLISH', ARGV[2], KEYS[1])
    return 1
end
return 0
