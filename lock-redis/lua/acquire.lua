-- Takes the lock and draws its fencing token, atomically.
--
-- acquire_batch.lua runs the same step for several locks in one script run;
-- the two must stay the same step (tests/fencing.rs and tests/batch.rs run
-- both). The step is written out here rather than as a shared function:
-- making the function at every run costs the server about 3,500
-- instructions (4% of a lock cycle's), which a batch pays once.
--
-- KEYS[1]  the lock key
-- KEYS[2]  its fencing companion key (same hash slot)
-- ARGV[1]  the owner token, `<node id>/<32 hex>`
-- ARGV[2]  the ttl in milliseconds
-- ARGV[3]  the companion's ttl in milliseconds: ARGV[2] plus the idle
--          period (RedisConfig::fence_idle)
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
-- The companion expires after the idle period, never while its lock is
-- held: an acquisition (here) and every extension set its expiry to the
-- lock's ttl plus the idle period, and a release leaves it (the lock was
-- held, so that is at least the idle period after the release). An
-- expired companion is a lost one, and a lost companion cannot make
-- tokens go back: the next token is at least the server clock in
-- microseconds, which is past every earlier token (each was the clock at
-- its drawing, or the counter, ahead of the clock only by as much as the
-- clock stepped back). An idle companion expires only after the idle
-- period, during which the clock moved on by that much again, so tokens
-- could go back only after the clock stepped back by more than it.
--
-- TIME before a write needs effects replication (replicas and the AOF get
-- the written values, never a re-run of the script): the only mode from
-- Redis 7, the default from Redis 5.
--
-- Returns 0 when the key is held by someone else, or -2 - PTTL when that
-- holder's key expires (two commands run, nothing written) [A9], else the new fencing token (>= 1): as a decimal string when it
-- is the clock, as an integer when it is the counter. Fails, having
-- changed nothing, when the companion holds anything but a decimal integer
-- from 1 to 2^53 - 2 (with no sign, point or leading zero).
--
-- The common path runs four commands and converts no number: the clock's
-- digits are joined as strings (TIME answers strings; Lua's tonumber and
-- number formatting are the costly parts of a script this small), the
-- companion is swapped with SET ... KEEPTTL GET (so that one holding no
-- counter is put back as it was, ttl included) and then given its expiry,
-- and the two tokens, digit strings without leading zeros, are compared
-- by length, then by their digits.
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
    -- [A9] Busy: how long the holder has left, when its key expires.
    -- (pcall: a user whose ACL lacks PTTL is told nothing.)
    local left = redis.pcall('PTTL', KEYS[1])
    if type(left) == 'number' and left >= 0 then
        return -2 - left
    end
    return 0
end
local now = redis.call('TIME')
local micros = now[2]
local clock = now[1] .. string.sub('00000', #micros) .. micros
-- KEEPTTL: a companion put back below is put back as it was.
local stored = redis.pcall('SET', KEYS[2], clock, 'KEEPTTL', 'GET')
if not stored then
    redis.call('PEXPIRE', KEYS[2], ARGV[3])
    return clock
end
if type(stored) == 'string' and #stored <= 16 and string.find(stored, '^[1-9]%d*$') then
    if #stored < #clock or (#stored == #clock and stored < clock) then
        redis.call('PEXPIRE', KEYS[2], ARGV[3])
        return clock
    end
    -- The counter is ahead of the clock: put it back and count on by one,
    -- while the sum stays exact in a Lua number (below 2^53). INCR keeps
    -- the expiry.
    if #stored < 16 or stored < '9007199254740991' then
        redis.call('SET', KEYS[2], stored, 'PX', ARGV[3])
        return redis.call('INCR', KEYS[2])
    end
end
-- Not a counter: put back what was there (nothing was written to a key of
-- another type), free the lock key just taken, and fail.
if type(stored) == 'string' then
    redis.call('SET', KEYS[2], stored, 'KEEPTTL')
end
redis.call('DEL', KEYS[1])
return redis.error_reply('ERR the fencing companion ' .. KEYS[2] .. ' is not a number below 2^53')
