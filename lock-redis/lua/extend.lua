-- Resets the expiry of a lock still held by the owner token. Never creates
-- a missing key.
--
-- KEYS[1]  the lock key
-- ARGV[1]  the owner token
-- ARGV[2]  the new ttl in milliseconds
--
-- (pcall: a key of another type, as a client that keeps its locks in a hash
-- makes, is another owner's lock, not an error.)
--
-- Returns 1 when extended, 0 when the key is missing (expired or deleted),
-- -1 when another owner holds it.
local holder = redis.pcall('GET', KEYS[1])
if holder == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return 1
end
if holder == false then
    return 0
end
return -1
