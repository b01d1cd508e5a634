-- Frees a lock for an operator, whoever holds it, but only a lock of
-- withlock's format, and announces the release; anything else is left
-- untouched. The check and the delete are one script run, so nothing can
-- change the key in between.
--
-- KEYS[1]  the lock key
-- KEYS[2]  its fencing companion (same hash slot)
-- KEYS[3]  the record of its minimum hold (same hash slot; read only: a
--          record left names the freed holder, and is not counted for
--          the next one)
-- ARGV[1]  the publish command: PUBLISH (one server, Sentinel) or
--          SPUBLISH (Redis Cluster, on the shard channel of KEYS[1]'s slot)
-- ARGV[2]  the release channel; the message is the lock key (KEYS[1]), as
--          release.lua and release_sharded.lua send it
-- ARGV[3]  the idle period in milliseconds (RedisConfig::fence_idle): the
--          freed lock's companion expires that long after, as after a
--          release, unless the key is taken again
--
-- The companion is kept (with that expiry), so the next token is above
-- the freed holder's; and a lost companion cannot make tokens go back
-- either, since each token is at least the server clock in microseconds
-- (see acquire.lua).
--
-- A lock of withlock's format is a string key whose value is an owner
-- token (`<node id>/<32 hex digits>`, the node id not empty), which has an
-- expiry, and whose fencing companion exists (every withlock acquisition
-- writes it). The owner-token test is OwnerToken::is_well_formed in
-- lock-core; tests/admin.rs checks that both agree.
--
-- Returns { verdict, value, pttl, counter, kept }, the last four as
-- admin_read.lua reads them, before any change. verdict is
--   'freed'      the key was deleted and the release published;
--   'free'       there is no key (nothing changed, nothing published);
--   'type'       the key is not a string (value is `<type>`);
--   'no-expiry'  a string without an expiry;
--   'format'     a string not in the owner-token format;
--   'no-fence'   an owner token with an expiry but no fencing companion.
local function read(key)
    local kind = redis.call('TYPE', key)['ok']
    if kind == 'string' then
        return redis.call('GET', key)
    elseif kind == 'none' then
        return false
    end
    return '<' .. kind .. '>'
end
local kind = redis.call('TYPE', KEYS[1])['ok']
local value = read(KEYS[1])
local pttl = redis.call('PTTL', KEYS[1])
local counter = read(KEYS[2])
local kept = read(KEYS[3])
local verdict
if kind == 'none' then
    verdict = 'free'
elseif kind ~= 'string' then
    verdict = 'type'
elseif pttl < 0 then
    verdict = 'no-expiry'
elseif not string.find(value, '^.+/' .. string.rep('%x', 32) .. '$') then
    verdict = 'format'
elseif redis.call('EXISTS', KEYS[2]) == 0 then
    verdict = 'no-fence'
else
    redis.call('DEL', KEYS[1])
    redis.call('PEXPIRE', KEYS[2], ARGV[3])
    redis.call(ARGV[1], ARGV[2], KEYS[1])
    verdict = 'freed'
end
return { verdict, value, pttl, counter, kept }
