-- Frees several locks, each as release.lua does (granting a lock whose key
-- has waiters queued to the first live one [F1]), in one atomic script
-- run: the releases that concurrent callers made at the same moment, sent
-- as one command. After fencing.lua and queue.lua.
--
-- KEYS[4i-3..4i]  the i-th lock key, its fencing companion, its queue and
--                 its waiters (all four in one hash slot)
-- ARGV[1]         the release channel; each message is a released lock
--                 key, or a grant's message (see queue.lua)
-- ARGV[2]         the companions' idle period in milliseconds
-- ARGV[3]         the grant channels' prefix: a grant goes to the
--                 grantee's node alone (see queue.lua's `hand_on`)
-- ARGV[i+3]       the owner token of the i-th lock
--
-- A free key's message is published only if someone listens (a
-- subscriber of the channel, or any pattern subscriber): asked once for
-- the whole batch, where a publication costs a command per lock. A grant
-- is always announced: its grantee listens.
--
-- Each companion keeps the expiry its lock's acquisition or last
-- extension gave it: at least the idle period after this release (see
-- release.lua). A companion that expires is lost, and a lost companion
-- cannot make tokens go back: each token is at least the server clock in
-- microseconds (see acquire.lua).
--
-- (pcall: a key of another type, as a client that keeps its locks in a hash
-- makes, is another owner's lock, not an error.)
--
-- Returns one answer per lock, in order: 1 released (or granted), 0 not
-- held by its owner token (nothing changed, nothing published), 2 granted
-- and the ACL refused the grant channel (it went on the release channel).
-- (pcall: a user whose ACL lacks PUBSUB, which the README's rules do not
-- list, publishes every release, as release.lua does.)
local subscribers = redis.pcall('PUBSUB', 'NUMSUB', ARGV[1])
local listened = subscribers.err ~= nil or subscribers[2] > 0
    or redis.call('PUBSUB', 'NUMPAT') > 0
local answers = {}
for i = 1, #KEYS / 4 do
    local lock = KEYS[4 * i - 3]
    answers[i] = 1
    if redis.pcall('GET', lock) == ARGV[i + 3] then
        if redis.pcall('EXISTS', KEYS[4 * i - 1]) == 1 then
            if hand_on(lock, KEYS[4 * i - 2], KEYS[4 * i - 1], KEYS[4 * i], ARGV[1], ARGV[2], now_ms(), 'PUBLISH', ARGV[3]) then
                answers[i] = 2
            end
        else
            redis.call('DEL', lock)
            if listened then
                redis.call('PUBLISH', ARGV[1], lock)
            end
        end
    else
        answers[i] = 0
    end
end
return answers
