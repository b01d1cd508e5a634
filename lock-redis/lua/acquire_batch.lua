-- Takes several locks, each as acquire.lua does, in one atomic script run:
-- the acquisitions that concurrent callers made at the same moment, sent
-- as one command (see fencing.lua for each).
--
-- KEYS[2i-1], KEYS[2i]              the i-th lock key and its fencing
--                                    companion
-- ARGV[3i-2], ARGV[3i-1], ARGV[3i]   its owner token, its ttl and its
--                                    companion's ttl (the ttl plus the idle
--                                    period) in milliseconds
--
-- A lost companion cannot make tokens go back: each token is at least the
-- server clock in microseconds (see fencing.lua).
--
-- Returns one answer per lock, in order: as acquire.lua's, with -1 in
-- place of the error of a lock whose companion is not a counter (an error
-- inside an answer would fail the whole command in most clients).
local answers = {}
for i = 1, #KEYS / 2 do
    local answer = acquire(KEYS[2 * i - 1], KEYS[2 * i], ARGV[3 * i - 2], ARGV[3 * i - 1], ARGV[3 * i])
    if type(answer) == 'table' then
        answer = -1
    end
    answers[i] = answer
end
return answers
