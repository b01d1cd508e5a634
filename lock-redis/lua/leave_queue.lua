-- Removes a waiter's place from the key's fair queue [F2], after
-- fencing.lua and queue.lua; a grant made to the waiter and not taken up
-- is handed on as a release would.
--
-- KEYS[1..4]  the lock key, its companion, queue and waiters
-- ARGV[1]     the owner token
-- ARGV[2]     the release channel
-- ARGV[3]     the companion's idle period in milliseconds
-- ARGV[4]     the publish command: PUBLISH (one server, Sentinel) or
--             SPUBLISH (Redis Cluster, on the shard channel of the slot)
-- ARGV[5]     the grant channels' prefix (one server, Sentinel; none on a
--             Cluster; see queue.lua's `hand_on`)
--
-- Returns 1 when a grant was handed on, 2 when it was and the ACL refused
-- the grant channel (it went on the release channel), else 0.
forget(KEYS[3], KEYS[4], ARGV[1])
if redis.pcall('GET', KEYS[1]) == ARGV[1] then
    if hand_on(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[2], ARGV[3], now_ms(), ARGV[4], ARGV[5]) then
        return 2
    end
    return 1
end
return 0
