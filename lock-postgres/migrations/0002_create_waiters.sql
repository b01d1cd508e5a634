-- The fair queue across nodes (SPEC F1-F3): a waiters table beside the lock
-- table, and the three steps that change it as functions.
--
-- The placeholders in double braces are the lock table (`table`) and the
-- queue's objects beside it (`waiters`, `queue_v1`, `release_v1`, `leave_v1`:
-- `<table>_waiters`, `<table>_queue_v1`, ...), each schema-qualified and
-- quoted as an identifier, and dollar-quote tags that occur in none of the
-- names (`do`, `body`). No comment holds a placeholder: a name may hold a
-- line break, which would end the comment. The backend runs this file inside a transaction that holds
-- the migration's advisory lock. Idempotent: running it again changes
-- nothing. The lock table is not touched: Ruby's Locker gem keeps working
-- on it, and never sees the queue.
--
-- One place per node and key: `ticket` orders the places (the store's
-- arrival order), `alive_until` is renewed by each of the waiter's attempts
-- (a place whose waiter stopped is skipped and removed), `claim_us` is how
-- long a grant to it lasts unless taken up.
CREATE TABLE IF NOT EXISTS {{waiters}} (
    key         text NOT NULL,
    owner       text NOT NULL,
    ticket      bigint GENERATED ALWAYS AS IDENTITY,
    alive_until timestamp without time zone NOT NULL,
    claim_us    bigint NOT NULL,
    PRIMARY KEY (key, owner)
);

-- Each step of the queue (a queued attempt, a release that grants, a leave)
-- first locks the key's row of the lock table, so the steps of one key run
-- one after the other; each statement of these VOLATILE functions then
-- sees everything committed before it ran (READ COMMITTED), in particular
-- every step the lock made it wait for. One call is one autocommit
-- statement, one round trip, with no session state: it works through a
-- transaction-pooling proxy. Every function runs with the caller's rights
-- (SECURITY INVOKER).
--
-- A function is created only when missing (never replaced), so that a
-- role other than its owner may run the migration again; a later version
-- that changes a body gives the function a new name (`_v2`).
DO {{do}}
BEGIN
    -- One attempt of a queued waiter: takes up a grant to it, or takes the
    -- free row when no live place is ahead of it, or keeps (or makes, at
    -- the tail) its place. Returns the fencing token when taken; else the
    -- holder's time left in microseconds to the queue's head only, and the
    -- last fencing token drawn for the key (the row's `sequence`): a grant
    -- with a greater one was made after this answer.
    CREATE FUNCTION {{queue_v1}}(
        p_key text, p_owner text, p_ttl_us bigint, p_ticket_ttl_us bigint, p_claim_us bigint,
        OUT fencing_token bigint, OUT expires_us bigint, OUT last_token bigint)
    LANGUAGE plpgsql VOLATILE AS {{body}}
    DECLARE
        t timestamp without time zone;
        held_by text;
        held_until timestamp without time zone;
        fence bigint;
        head text;
    BEGIN
        SELECT l.locked_by, l.locked_until, l.sequence INTO held_by, held_until, fence
          FROM {{table}} AS l WHERE l.key = p_key FOR UPDATE;
        IF NOT FOUND THEN
            INSERT INTO {{table}} (key) VALUES (p_key) ON CONFLICT (key) DO NOTHING;
            SELECT l.locked_by, l.locked_until, l.sequence INTO held_by, held_until, fence
              FROM {{table}} AS l WHERE l.key = p_key FOR UPDATE;
        END IF;
        t := clock_timestamp() AT TIME ZONE 'UTC';
        -- Places whose waiter stopped renewing them (this waiter's own
        -- too: a stalled waiter that returns joins at the tail).
        DELETE FROM {{waiters}} AS w WHERE w.key = p_key AND w.alive_until < t;
        -- A grant to this waiter: taken up, its ttl from now.
        IF held_by = p_owner AND held_until >= t THEN
            UPDATE {{table}} AS l SET locked_until = t + p_ttl_us * interval '1 microsecond'
             WHERE l.key = p_key;
            DELETE FROM {{waiters}} AS w WHERE w.key = p_key AND w.owner = p_owner;
            fencing_token := fence;
            RETURN;
        END IF;
        SELECT w.owner INTO head FROM {{waiters}} AS w
         WHERE w.key = p_key ORDER BY w.ticket LIMIT 1;
        -- The free row, when nobody live is ahead: taken as the lock step
        -- takes it, with the same fencing token rule.
        IF (held_by IS NULL OR held_until < t) AND (head IS NULL OR head = p_owner) THEN
            UPDATE {{table}} AS l
               SET locked_by = p_owner, locked_at = t,
                   locked_until = t + p_ttl_us * interval '1 microsecond',
                   sequence = GREATEST(l.sequence + 1, (extract(epoch FROM t) * 1000000)::bigint)
             WHERE l.key = p_key
            RETURNING l.sequence::bigint INTO fencing_token;
            DELETE FROM {{waiters}} AS w WHERE w.key = p_key AND w.owner = p_owner;
            RETURN;
        END IF;
        -- Busy: the place is kept, with its ticket, or made at the tail.
        UPDATE {{waiters}} AS w
           SET alive_until = t + p_ticket_ttl_us * interval '1 microsecond', claim_us = p_claim_us
         WHERE w.key = p_key AND w.owner = p_owner;
        IF NOT FOUND THEN
            INSERT INTO {{waiters}} (key, owner, alive_until, claim_us)
            VALUES (p_key, p_owner, t + p_ticket_ttl_us * interval '1 microsecond', p_claim_us);
        END IF;
        IF (head IS NULL OR head = p_owner) AND held_by IS NOT NULL AND held_until >= t THEN
            expires_us := (extract(epoch FROM (held_until - t)) * 1000000)::bigint;
        END IF;
        last_token := fence;
    END
    {{body}};
EXCEPTION WHEN duplicate_function THEN NULL;
END
{{do}};

DO {{do}}
BEGIN
    -- The release of a key that has a queue: if p_owner holds the row, it
    -- is granted to the first live place (for that place's claim deadline,
    -- with a new fencing token; the place is removed), announced on
    -- p_grant_channel as `<token>:<claim µs>:<owner length in
    -- characters>:<owner><key>`; with no live place, the row is freed and
    -- its key announced on p_channel, as a plain release. A row whose
    -- holder's time ran out is freed, not granted. Returns whether the
    -- lease was still valid; NULL when p_owner did not hold the row.
    CREATE FUNCTION {{release_v1}}(p_key text, p_owner text, p_channel text, p_grant_channel text)
    RETURNS boolean LANGUAGE plpgsql VOLATILE AS {{body}}
    DECLARE
        t timestamp without time zone;
        held_until timestamp without time zone;
        head_owner text;
        head_claim bigint;
        fence bigint;
    BEGIN
        SELECT l.locked_until INTO held_until FROM {{table}} AS l
         WHERE l.key = p_key AND l.locked_by = p_owner FOR UPDATE;
        IF NOT FOUND THEN
            RETURN NULL;
        END IF;
        t := clock_timestamp() AT TIME ZONE 'UTC';
        IF held_until >= t THEN
            SELECT w.owner, w.claim_us INTO head_owner, head_claim FROM {{waiters}} AS w
             WHERE w.key = p_key AND w.alive_until >= t ORDER BY w.ticket LIMIT 1;
            IF FOUND THEN
                UPDATE {{table}} AS l
                   SET locked_by = head_owner, locked_at = t,
                       locked_until = t + head_claim * interval '1 microsecond',
                       sequence = GREATEST(l.sequence + 1, (extract(epoch FROM t) * 1000000)::bigint)
                 WHERE l.key = p_key
                RETURNING l.sequence::bigint INTO fence;
                DELETE FROM {{waiters}} AS w WHERE w.key = p_key AND w.owner = head_owner;
                PERFORM pg_notify(p_grant_channel,
                    format('%s:%s:%s:%s%s', fence, head_claim, char_length(head_owner), head_owner, p_key));
                RETURN true;
            END IF;
        END IF;
        UPDATE {{table}} AS l SET locked_by = NULL WHERE l.key = p_key;
        PERFORM pg_notify(p_channel, p_key);
        RETURN held_until >= t;
    END
    {{body}};
EXCEPTION WHEN duplicate_function THEN NULL;
END
{{do}};

DO {{do}}
BEGIN
    -- A waiter leaves: its place is removed; a grant to it that it did not
    -- take up is handed on as a release would; a free row whose queue
    -- still has a live place is announced, so that the next waiter tries
    -- at once.
    CREATE FUNCTION {{leave_v1}}(p_key text, p_owner text, p_channel text, p_grant_channel text)
    RETURNS void LANGUAGE plpgsql VOLATILE AS {{body}}
    DECLARE
        t timestamp without time zone;
        held_by text;
        held_until timestamp without time zone;
    BEGIN
        SELECT l.locked_by, l.locked_until INTO held_by, held_until FROM {{table}} AS l
         WHERE l.key = p_key FOR UPDATE;
        DELETE FROM {{waiters}} AS w WHERE w.key = p_key AND w.owner = p_owner;
        t := clock_timestamp() AT TIME ZONE 'UTC';
        IF held_by = p_owner THEN
            PERFORM {{release_v1}}(p_key, p_owner, p_channel, p_grant_channel);
        ELSIF (held_by IS NULL OR held_until < t)
              AND EXISTS (SELECT 1 FROM {{waiters}} AS w WHERE w.key = p_key AND w.alive_until >= t) THEN
            PERFORM pg_notify(p_channel, p_key);
        END IF;
    END
    {{body}};
EXCEPTION WHEN duplicate_function THEN NULL;
END
{{do}};
