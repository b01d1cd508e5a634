-- Takes several locks, each as acquire.lua does, in one atomic script run:
-- the acquisitions that concurrent callers made at the same moment, sent
-- as one command (see fencing.lua for each).
--
-- KEYS[2i-1], KEYS[2i]  the i-th lock key and its fencing companion
-- ARGV[2i-1], ARGV[2i]  its owner token and ttl in milliseconds
--
-- Returns one answer per lock, in order: as acquire.lua's, with -1 in
-- place of the error of a lock whose companion is not a counter (an error
-- inside an answer would fail the whole command in most clients).
local answers = {}
for i = 1, #KEYS / 2 do
    local answer = acquire(KEYS[2 * i - 1], KEYS[2 * i], ARGV[2 * i - 1], ARGV[2 * i])
    if type(answer) == 'table' then
        answer = -1
    end
    answers[i] = answer
end
return answers
