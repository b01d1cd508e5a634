-- The minimum hold [H7]: extend.lua's step (which follows this part in the
-- same script, lua/hold.lua being the two joined) with the time left of
-- the hold, and beside it a record that the holder's run has ended, for
-- the admin functions.
--
-- KEYS[1]  the lock key
-- KEYS[2]  its fencing companion (same hash slot)
-- KEYS[3]  the hold's record, {T}:withlock-kept:<lock key> (same hash slot)
-- ARGV     as extend.lua's: ARGV[1] the owner token, ARGV[2] the time left
--          of the hold in milliseconds, ...
--
-- The record holds the owner token and expires with the lock (the same
-- PX, set in the same script run), so the admin counts it only while it
-- names the lock key's own value: a record of an earlier holder (a kept
-- lock freed by force and taken again) names another token and is not
-- counted. The lock key itself keeps the value every client of the wire
-- format compares with its token; nothing else of it changes.
--
-- Written only when the lock key holds the owner token (the extension
-- below then succeeds). pcall: a record that cannot be written (a server
-- out of memory refuses the SET) leaves the hold as it is; the admin then
-- shows the lock as running. A user whose ACL does not reach the record's
-- name is refused the whole call before it runs (the server checks the
-- declared keys): the backend then sends extend.lua alone.
if redis.pcall('GET', KEYS[1]) == ARGV[1] then
    redis.pcall('SET', KEYS[3], ARGV[1], 'PX', ARGV[2])
end
