-- Takes the lock and draws its fencing token, atomically.
--
-- KEYS[1]  the lock key
-- KEYS[2]  its fencing companion key (same hash slot; never expires)
-- ARGV[1]  the owner token, `<node id>/<32 hex>`
-- ARGV[2]  the ttl in milliseconds
--
-- The token is max(companion + 1, server clock in microseconds since the
-- Unix epoch), and is stored back in the companion. The counter term makes
-- tokens strictly increase even within one microsecond or when the clock
-- steps back; the clock term keeps them increasing when the companion is
-- lost (a restart without persistence, FLUSHALL, eviction, a failover to a
-- replica that missed the write): the next token is the clock, above every
-- earlier token as long as the clock did not step back by more than the
-- counter's lead over it.
--
-- TIME before a write needs effects replication (replicas and the AOF get
-- the written values, never a re-run of the script): the only mode from
-- Redis 7, the default from Redis 5.
--
-- Returns the new fencing token (>= 1) when the lock was taken, 0 when the
-- key is held by someone else. Fails, having written nothing, when the
-- companion holds something other than a number below 2^53.
local stored = redis.call('GET', KEYS[2])
local counter = 0
if stored then
    counter = tonumber(stored)
    -- Lua numbers are doubles, exact up to 2^53 (about the year 2255 in
    -- microseconds): above it, counter + 1 could equal counter.
    if not counter or counter >= 9007199254740991 then
        return redis.error_reply('ERR the fencing companion ' .. KEYS[2] .. ' is not a number below 2^53')
    end
end
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
    return 0
end
local now = redis.call('TIME')
local token = math.max(counter + 1, tonumber(now[1]) * 1000000 + tonumber(now[2]))
-- '%.0f' writes every digit, where Redis's own conversion of a number
-- argument keeps only 14 significant digits.
redis.call('SET', KEYS[2], string.format('%.0f', token))
return token
