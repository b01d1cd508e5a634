-- Frees several locks, each as release_unqueued.lua does (for a user whose
-- ACL does not reach the fair queue's keys [F6]; release_batch.lua
-- otherwise), in one atomic script run:
-- the releases that concurrent callers made at the same moment, sent as
-- one command.
--
-- KEYS[i]              the i-th lock key
-- ARGV[1]               the release channel; each message is a released
--                       lock key
-- ARGV[i+1]             the owner token of the i-th lock
--
-- The messages are published only if someone listens (a subscriber of the
-- channel, or any pattern subscriber): asked once for the whole batch,
-- where a publication costs a command per lock.
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
-- Returns one answer per lock, in order: 1 released, 0 not held by its
-- owner token (nothing changed, nothing published).
-- (pcall: a user whose ACL lacks PUBSUB, which the README's rules do not
-- list, publishes every release, as release.lua does.)
local subscribers = redis.pcall('PUBSUB', 'NUMSUB', ARGV[1])
local listened = subscribers.err ~= nil or subscribers[2] > 0
    or redis.call('PUBSUB', 'NUMPAT') > 0
local answers = {}
for i = 1, #KEYS do
    local lock = KEYS[i]
    if redis.pcall('GET', lock) == ARGV[i + 1] then
        redis.call('DEL', lock)
        if listened then
            redis.call('PUBLISH', ARGV[1], lock)
        end
        answers[i] = 1
    else
        answers[i] = 0
    end
end
return answers
