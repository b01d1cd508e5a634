-- Frees a lock still held by the owner token and announces the release;
-- when waiters are queued [F1], grants it to the first live one instead.
--
-- KEYS[1]  the lock key
-- KEYS[2]  its fencing companion
-- KEYS[3]  its queue (sorted set; see queue.lua)
-- KEYS[4]  its waiters (hash; see queue.lua)
-- ARGV[1]  the owner token
-- ARGV[2]  the release channel; the message is the lock key (KEYS[1]), or
--          a grant's message (see queue.lua)
-- ARGV[3]  the companion's idle period in milliseconds
-- ARGV[4]  the publish command: PUBLISH (one server, Sentinel; the
--          default) or SPUBLISH (Redis Cluster, ARGV[2] the shard
--          channel of the key's slot)
-- ARGV[5]  the grant channels' prefix (one server, Sentinel; none on a
--          Cluster): a grant goes to `ARGV[5] .. <the grantee's node id>`
--          alone [F4], or to the release channel where nobody listens
--          there (see queue.lua's `hand_on`)
--
-- The common release (nobody queued) runs three commands, as before the
-- queue but for the EXISTS of the queue. The grant is queue.lua's
-- `hand_on` and fencing.lua's `acquire`, written out inline: a function
-- made at every run costs the server about 3,500 instructions, which every
-- release would pay (tests/fair.rs runs this script and the batch's).
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
-- Returns 1 when released (or granted), 0 when the key was not held by the
-- owner token (nothing changed, nothing published), 2 when granted and the
-- ACL refused the grant channel (the grant went on the release channel).
local lock = KEYS[1]
if redis.pcall('GET', lock) ~= ARGV[1] then
    return 0
end
-- (pcall: a user whose ACL lacks the queue's commands has no queue.)
if redis.pcall('EXISTS', KEYS[3]) == 1 then
    redis.call('DEL', lock)
    local fence, queue, waiters = KEYS[2], KEYS[3], KEYS[4]
    local time = redis.call('TIME')
    local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
    while true do
        local head = redis.call('ZRANGE', queue, 0, 0)[1]
        if not head then
            break
        end
        local place = redis.call('HGET', waiters, head)
        local alive, claim
        if place then
            alive, claim = string.match(place, '^(%d+):(%d+)$')
        end
        if not (alive and tonumber(alive) > now) then
            -- A dead place [F2].
            redis.call('ZREM', queue, head)
            redis.call('HDEL', waiters, head)
        else
            -- [F5] After grants in a row for 10 s, the key is left free
            -- for 600 ms for clients outside the queue, nobody told (see
            -- queue.lua); the head keeps its place.
            local since = tonumber(redis.call('HGET', waiters, ''))
            if not since then
                redis.call('HSET', waiters, '', now)
            elseif now - since >= 10000 then
                redis.call('HDEL', waiters, '')
                redis.call('HSET', waiters, '!', now + 600)
                return 1
            end
            redis.call('ZREM', queue, head)
            redis.call('HDEL', waiters, head)
            -- The grant: the head holds the lock for its claim deadline,
            -- with the next fencing token (acquire.lua's step).
            redis.call('SET', lock, head, 'PX', claim)
            local micros = time[2]
            local clock = time[1] .. string.sub('00000', #micros) .. micros
            local fence_ttl = tonumber(claim) + tonumber(ARGV[3])
            local stored = redis.pcall('SET', fence, clock, 'KEEPTTL', 'GET')
            local token
            if not stored then
                token = clock
            elseif type(stored) == 'string' and #stored <= 16 and string.find(stored, '^[1-9]%d*$') then
                if #stored < #clock or (#stored == #clock and stored < clock) then
                    token = clock
                elseif #stored < 16 or stored < '9007199254740991' then
                    redis.call('SET', fence, stored, 'PX', fence_ttl)
                    token = redis.call('INCR', fence)
                end
            end
            if not token then
                -- Not a counter: put back what was there and leave the key
                -- free, as acquire.lua does.
                if type(stored) == 'string' then
                    redis.call('SET', fence, stored, 'KEEPTTL')
                end
                redis.call('DEL', lock)
                break
            end
            if token == clock then
                redis.call('PEXPIRE', fence, fence_ttl)
            end
            local message = '\0grant ' .. token .. ' ' .. claim .. ' ' .. #head .. '\n' .. head .. lock
            local node = ARGV[5] and string.match(head, '^(.*)/')
            local heard = node and redis.pcall('PUBLISH', ARGV[5] .. node, message)
            if type(heard) == 'number' and heard > 0 then
                return 1
            end
            redis.call(ARGV[4] or 'PUBLISH', ARGV[2], message)
            if type(heard) == 'table' then
                return 2
            end
            return 1
        end
    end
    -- Nobody live queued: the run of grants ends.
    redis.call('HDEL', waiters, '')
end
redis.call('DEL', lock)
redis.call(ARGV[4] or 'PUBLISH', ARGV[2], lock)
return 1
