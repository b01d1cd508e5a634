-- Resets the expiry of a lock still held by the owner token, and its
-- fencing companion's. Never creates a missing lock key.
--
-- KEYS[1]  the lock key
-- KEYS[2]  its fencing companion (same hash slot)
-- ARGV[1]  the owner token
-- ARGV[2]  the new ttl in milliseconds
-- ARGV[3]  the companion's new ttl in milliseconds: ARGV[2] plus the idle
--          period (RedisConfig::fence_idle), so that the companion of a
--          held lock always outlives it
-- ARGV[4]  the lease's fencing token
--
-- While the lock is held its companion holds the lease's token (the last
-- drawn for the key: any other acquisition fails its SET NX before it
-- draws one), unless it was lost (deleted by hand, a failover to a replica
-- that missed it) or is stale (a failover to a replica that missed the
-- acquisition's write but had an older companion). Then the extension
-- writes it back holding the lease's token, so that the admin functions,
-- which find locks by their companions, find this one with its token. A
-- companion that is anything else (not a decimal number, a key of another
-- type, a number above the token) is not ours to overwrite: it only gets
-- its expiry, as before. A lost or stale companion cannot make tokens go
-- back meanwhile: each token is at least the server clock in microseconds
-- (see acquire.lua).
--
-- (pcall: a key of another type, as a client that keeps its locks in a hash
-- makes, is another owner's lock, not an error.)
--
-- Returns 1 when extended, 0 when the key is missing (expired or deleted),
-- -1 when another owner holds it.
local holder = redis.pcall('GET', KEYS[1])
if holder == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    -- Missing, or a number below the token (digit strings without leading
    -- zeros: shorter is smaller), is lost or stale; anything else (the
    -- token itself in the common case) keeps its value.
    local stored = redis.pcall('GET', KEYS[2])
    if not stored or (type(stored) == 'string' and string.find(stored, '^[1-9]%d*$')
            and (#stored < #ARGV[4] or (#stored == #ARGV[4] and stored < ARGV[4]))) then
        redis.call('SET', KEYS[2], ARGV[4], 'PX', ARGV[3])
    else
        redis.call('PEXPIRE', KEYS[2], ARGV[3])
    end
    return 1
end
if holder == false then
    return 0
end
return -1
