-- One attempt of a waiter in the key's fair queue [F1-F3], after
-- fencing.lua and queue.lua (see there for the queue's keys).
--
-- KEYS[1]  the lock key
-- KEYS[2]  its fencing companion
-- KEYS[3]  its queue (sorted set)
-- KEYS[4]  its waiters (hash)
-- ARGV[1]  the owner token, the same for the waiter's whole wait
-- ARGV[2]  the ttl in milliseconds
-- ARGV[3]  the companion's ttl: ARGV[2] plus the idle period
-- ARGV[4]  the ticket ttl in milliseconds
-- ARGV[5]  the claim deadline in milliseconds
--
-- In one step: takes up a grant (the lock holds the owner token: its
-- expiry becomes the ttl, its token is the grant's, kept in the
-- companion since nobody could draw one while the key was held); or takes
-- a free lock, as acquire.lua does, when no live place is ahead of the
-- owner's; or else keeps the owner's place (made at the tail the first
-- time) alive for the ticket ttl.
--
-- Returns the fencing token (>= 1) when the lock is the owner's; when
-- not, a pair: 0, or -2 - PTTL when the owner's place is the head and the
-- holder's expiry is known [A9]; and the last fencing token drawn for the
-- key (the companion's value, a decimal string), or -1 when the companion
-- holds none: a grant announced with a greater token was made after this
-- answer, so the waiter may start on it without a round trip.
local lock, fence, queue, waiters = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local owner, ticket_ttl = ARGV[1], tonumber(ARGV[4])
local now = now_ms()
local head = head_of(queue, waiters, now)
local holder = redis.pcall('GET', lock)
if holder == owner then
    redis.call('PEXPIRE', lock, ARGV[2])
    redis.call('PEXPIRE', fence, ARGV[3])
    forget(queue, waiters, owner)
    local token = redis.call('GET', fence)
    if not token then
        return redis.error_reply('ERR the fencing companion ' .. fence .. ' of a granted lock is missing')
    end
    return token
end
-- [F5] A gap left for clients outside the queue: the head waits it out.
local gap = not holder and tonumber(redis.call('HGET', waiters, '!'))
if gap and gap <= now then
    redis.call('HDEL', waiters, '!')
    gap = nil
end
if not holder and not gap and (not head or head == owner) then
    local token = acquire(lock, fence, owner, ARGV[2], ARGV[3])
    if type(token) == 'table' or (type(token) == 'number' and token <= 0) then
        return token
    end
    -- Taken free, not granted: the run of grants ends.
    redis.call('HDEL', waiters, '')
    forget(queue, waiters, owner)
    return token
end
if not redis.call('ZSCORE', queue, owner) then
    local last = redis.call('ZRANGE', queue, -1, -1, 'WITHSCORES')[2]
    redis.call('ZADD', queue, (tonumber(last) or 0) + 1, owner)
end
redis.call('HSET', waiters, owner, string.format('%d:%s', now + ticket_ttl, ARGV[5]))
-- The queue's keys live a ticket ttl past the last attempt (waiters of
-- one key share their terms; one with a longer ticket ttl than the
-- last attempt's renews its place in time all the same, every third of
-- its own, unless the key sees no other attempt for longer).
redis.call('PEXPIRE', queue, ticket_ttl)
redis.call('PEXPIRE', waiters, ticket_ttl)
local last = redis.pcall('GET', fence)
if type(last) ~= 'string' or not string.find(last, '^[1-9]%d*$') then
    last = -1
end
if head and head ~= owner then
    return {0, last}
end
if gap then
    return {-2 - (gap - now), last}
end
if type(holder) ~= 'string' then
    return {0, last}
end
local left = redis.call('PTTL', lock)
if left >= 0 then
    return {-2 - left, last}
end
return {0, last}
