-- The fair queue's steps as functions [F1-F3], for the scripts that
-- follow this file (acquire_queued.lua, leave_queue.lua,
-- release_batch.lua); fencing.lua's `acquire` comes before it. release.lua
-- writes the same hand-on out inline (a function made at every run costs
-- the server about 3,500 instructions, which the common release would
-- pay); tests/fair.rs runs both.
--
-- A key's queue is two keys in the lock key's hash slot:
--   queue    a sorted set: each waiting owner token, scored by its arrival
--            (1 + the last score, so first come, first served)
--   waiters  a hash: each waiting owner token -> "<alive until>:<claim>",
--            the server time in milliseconds until which the place lives
--            (renewed by each of the waiter's attempts, a ticket ttl
--            ahead) and how long a grant to it lasts, in milliseconds
-- Both expire a ticket ttl after the last attempt renewed a place: by
-- then every place in them is dead. Two fields of the waiters hash are no
-- owner token (a token holds a '/'): '' holds when the key's current run
-- of grants began, '!' until when the key is left free for clients
-- outside the queue [F5] (see `hand_on`).

-- [F5] After grants in a row for this long (ms), a release leaves the key
-- free for GAP ms instead of granting it, and the queue's head waits out
-- the gap: a client polling outside the queue (the gem every 500 ms,
-- other libraries' retries) then gets the key within about STREAK + GAP
-- plus its poll interval, while the queue costs GAP in STREAK (6%) of a
-- key's throughput only when it is contended that long. release.lua has
-- the same numbers.
local STREAK = 10000
local GAP = 600

-- The server clock in milliseconds.
local function now_ms()
    local time = redis.call('TIME')
    return tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
end

-- Removes `owner`'s place.
local function forget(queue, waiters, owner)
    redis.call('ZREM', queue, owner)
    redis.call('HDEL', waiters, owner)
end

-- The first live place of the queue, and its claim in milliseconds;
-- dead places before it are dropped [F2].
local function head_of(queue, waiters, now)
    while true do
        local first = redis.call('ZRANGE', queue, 0, 0)[1]
        if not first then
            return nil
        end
        local place = redis.call('HGET', waiters, first)
        if place then
            local alive, claim = string.match(place, '^(%d+):(%d+)$')
            if alive and tonumber(alive) > now then
                return first, claim
            end
        end
        forget(queue, waiters, first)
    end
end

-- Frees `lock` (the caller checked that its releasing owner holds it) and
-- grants it to the queue's head [F1], for the head's claim deadline, with
-- a new fencing token, or frees it when nobody live waits; announces
-- either on `channel` with `publish` (PUBLISH, or SPUBLISH on a cluster's
-- shard channel of the key's slot): a grant as
--   "\0grant <fencing token> <claim ms> <length of the owner>\n<owner><lock key>"
-- (no lock key starts with NUL: the driver refuses keys holding one),
-- a free key as the lock key alone, as before the queue.
--
-- With `grants` (one server, Sentinel), the grant goes instead to the
-- grantee's node alone [F4], on `grants .. <node id>` (the owner token up
-- to its last '/'), where its backend listens from before its first
-- queued attempt: every other node's subscription stays asleep. Where
-- nobody listens there (a node of an earlier version, or one whose ACL
-- refused it the channel: PUBLISH answers 0), or the releaser's ACL
-- refuses the channel, it goes on `channel` as before. Returns true in
-- that last case, for the backend to log it once.
local function hand_on(lock, fence, queue, waiters, channel, fence_idle, now, publish, grants)
    local head, claim = head_of(queue, waiters, now)
    redis.call('DEL', lock)
    if head then
        local since = tonumber(redis.call('HGET', waiters, ''))
        if not since then
            redis.call('HSET', waiters, '', now)
        elseif now - since >= STREAK then
            -- [F5] The gap: the key stays free, nobody is told (the head
            -- finds it out at its next attempt, and waits out the gap).
            redis.call('HDEL', waiters, '')
            redis.call('HSET', waiters, '!', now + GAP)
            return false
        end
    end
    if head then
        local token = acquire(lock, fence, head, claim, tonumber(claim) + tonumber(fence_idle))
        if type(token) ~= 'table' then
            forget(queue, waiters, head)
            local message = '\0grant ' .. token .. ' ' .. claim .. ' ' .. #head .. '\n' .. head .. lock
            local node = grants and string.match(head, '^(.*)/')
            local heard = node and redis.pcall('PUBLISH', grants .. node, message)
            if type(heard) == 'number' and heard > 0 then
                return false
            end
            redis.call(publish, channel, message)
            return type(heard) == 'table'
        end
        -- A companion that holds no counter: the key stays free (acquire
        -- deleted it again), and the head finds that out itself.
    else
        -- Nobody live queued: the run of grants ends.
        redis.call('HDEL', waiters, '')
    end
    redis.call(publish, channel, lock)
    return false
end
