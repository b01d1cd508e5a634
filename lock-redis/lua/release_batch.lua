-- Frees several locks, each as release.lua does, in one atomic script run:
-- the releases that concurrent callers made at the same moment, sent as
-- one command.
--
-- KEYS[2i-1], KEYS[2i]  the i-th lock key and its fencing companion
-- ARGV[1]               the release channel; each message is a released
--                       lock key
-- ARGV[2]               the idle period in milliseconds
--                       (RedisConfig::fence_idle): a freed lock's
--                       companion expires that long after the release
-- ARGV[i+2]             the owner token of the i-th lock
--
-- The messages are published only if someone listens (a subscriber of the
-- channel, or any pattern subscriber): asked once for the whole batch,
-- where a publication costs a command per lock.
--
-- A companion that expires is lost, and a lost companion cannot make
-- tokens go back: each token is at least the server clock in microseconds
-- (see acquire.lua).
--
-- (pcall: a key of another type, as a client that keeps its locks in a hash
-- makes, is another owner's lock, not an error.)
--
-- Returns one answer per lock, in order: 1 released, 0 not held by its
-- owner token (nothing changed, nothing published).
local listened = redis.call('PUBSUB', 'NUMSUB', ARGV[1])[2] > 0
    or redis.call('PUBSUB', 'NUMPAT') > 0
local answers = {}
for i = 1, #KEYS / 2 do
    local lock = KEYS[2 * i - 1]
    if redis.pcall('GET', lock) == ARGV[i + 2] then
        redis.call('DEL', lock)
        redis.call('PEXPIRE', KEYS[2 * i], ARGV[2])
        if listened then
            redis.call('PUBLISH', ARGV[1], lock)
        end
        answers[i] = 1
    else
        answers[i] = 0
    end
end
return answers
