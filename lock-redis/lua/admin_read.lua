-- Reads one lock for an operator, whatever the types of its keys: what the
-- lock key holds, its remaining ttl, and the fencing counter. Changes
-- nothing.
--
-- KEYS[1]  the lock key
-- KEYS[2]  its fencing companion (same hash slot)
-- KEYS[3]  the record of its minimum hold, {T}:withlock-kept:<lock key>
--          (same hash slot; see hold_record.lua)
--
-- Returns { value, pttl, counter, kept }: a value is the string the key
-- holds, nil when there is no key, or `<type>` for a key of another type
-- (a client that keeps its locks in a hash makes those); pttl as PTTL
-- gives it (-2 no key, -1 no expiry); kept is the record's value (the
-- owner token of the holder whose run ended), counted by the reader only
-- when it is the lock key's value.
local function read(key)
    local kind = redis.call('TYPE', key)['ok']
    if kind == 'string' then
        return redis.call('GET', key)
    elseif kind == 'none' then
        return false
    end
    return '<' .. kind .. '>'
end
return { read(KEYS[1]), redis.call('PTTL', KEYS[1]), read(KEYS[2]), read(KEYS[3]) }
