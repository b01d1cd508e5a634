-- Frees several locks, each as release.lua does, in one atomic script run:
-- the releases that concurrent callers made at the same moment, sent as
-- one command.
--
-- KEYS[i]    the i-th lock key
-- ARGV[1]    the release channel; each message is a released lock key
-- ARGV[i+1]  the owner token of KEYS[i]
--
-- The messages are published only if someone listens (a subscriber of the
-- channel, or any pattern subscriber): asked once for the whole batch,
-- where a publication costs a command per lock.
--
-- (pcall: a key of another type, as a client that keeps its locks in a hash
-- makes, is another owner's lock, not an error.)
--
-- Returns one answer per lock, in order: 1 released, 0 not held by its
-- owner token (nothing changed, nothing published).
local listened = redis.call('PUBSUB', 'NUMSUB', ARGV[1])[2] > 0
    or redis.call('PUBSUB', 'NUMPAT') > 0
local answers = {}
for i = 1, #KEYS do
    if redis.pcall('GET', KEYS[i]) == ARGV[i + 1] then
        redis.call('DEL', KEYS[i])
        if listened then
            redis.call('PUBLISH', ARGV[1], KEYS[i])
        end
        answers[i] = 1
    else
        answers[i] = 0
    end
end
return answers
