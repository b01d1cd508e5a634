-- Frees a lock still held by the owner token and announces the release.
--
-- KEYS[1]  the lock key
-- ARGV[1]  the owner token
-- ARGV[2]  the release channel; the message is the lock key (KEYS[1])
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
