-- Callers outside the fair queue are not starved (SPEC F5): after grants
-- in a row for 10 s, a release leaves the key free for 600 ms instead of
-- granting it, and tells nobody; the queue's head keeps its place and
-- waits the gap out. A client polling outside the queue (Ruby's Locker
-- gem every 500 ms, a `no_queue()` caller) then gets the key within about
-- 10 s, plus the hold that ends the run, the gap and its poll interval,
-- while the queue keeps it busy. The numbers are the Redis backend's.
--
-- The placeholders in double braces are those of 0002 (`table`,
-- `waiters`, `do`, `body`), the runs table (`streaks`) and this version's
-- functions (`queue_v2`, `release_v2`, `leave_v2`). No comment holds a
-- placeholder: a name may hold a line break, which would end the comment.
-- The backend runs this file inside a transaction that holds the
-- migration's advisory lock. Idempotent: running it again changes nothing.
--
-- 0002's functions stay as they are (functions are never replaced):
-- nodes of the earlier version keep calling them during a rolling
-- upgrade, and grant without gaps. These are new functions, `_v2`: the
-- queued attempt and the release with the gap, and the leave, which
-- hands an untaken grant on through the new release.
--
-- One row per key whose queue granted it lately. `began`: when the key's
-- current run of grants began; `last_token`: the fencing token of the
-- run's last grant. The run goes on only while the key's holder is that
-- grantee (its token is the row's `sequence`): any other acquisition (a
-- free row taken, Ruby's `get`, an unqueued attempt after a release that
-- found nobody live queued) draws another token, and so ends the run
-- without a write here. `gap_until`: until when the key is left free.
-- A queued waiter that takes the key free removes the row.
CREATE TABLE IF NOT EXISTS {{streaks}} (
    key        text PRIMARY KEY,
    began      timestamp without time zone,
    last_token bigint,
    gap_until  timestamp without time zone
);

-- As in 0002, each function locks the key's row of the lock table first,
-- so the queue's steps on one key (and the writes to the runs table) run
-- one after the other; runs with the caller's rights (SECURITY INVOKER);
-- is created only when missing.
DO {{do}}
BEGIN
    -- 0002's queued attempt, and the gap: while the key is left free for
    -- clients outside the queue, no queued waiter takes it, and the
    -- queue's head is told the gap's time left (SPEC A9 then wakes it at
    -- the gap's end). It reads the runs table at every call, so that a
    -- role without rights on it is refused at its first queued attempt.
    CREATE FUNCTION {{queue_v2}}(
        p_key text, p_owner text, p_ttl_us bigint, p_ticket_ttl_us bigint, p_claim_us bigint,
        OUT fencing_token bigint, OUT expires_us bigint, OUT last_token bigint)
    LANGUAGE plpgsql VOLATILE AS {{body}}
    DECLARE
        t timestamp without time zone;
        held_by text;
        held_until timestamp without time zone;
        fence bigint;
        head text;
        gap timestamp without time zone;
    BEGIN
        SELECT l.locked_by, l.locked_until, l.sequence INTO held_by, held_until, fence
          FROM {{table}} AS l WHERE l.key = p_key FOR UPDATE;
        IF NOT FOUND THEN
            INSERT INTO {{table}} (key) VALUES (p_key) ON CONFLICT (key) DO NOTHING;
            SELECT l.locked_by, l.locked_until, l.sequence INTO held_by, held_until, fence
              FROM {{table}} AS l WHERE l.key = p_key FOR UPDATE;
        END IF;
        t := clock_timestamp() AT TIME ZONE 'UTC';
        SELECT s.gap_until INTO gap FROM {{streaks}} AS s WHERE s.key = p_key;
        IF gap <= t THEN
            gap := NULL;
        END IF;
        DELETE FROM {{waiters}} AS w WHERE w.key = p_key AND w.alive_until < t;
        IF held_by = p_owner AND held_until >= t THEN
            UPDATE {{table}} AS l SET locked_until = t + p_ttl_us * interval '1 microsecond'
             WHERE l.key = p_key;
            DELETE FROM {{waiters}} AS w WHERE w.key = p_key AND w.owner = p_owner;
            fencing_token := fence;
            RETURN;
        END IF;
        SELECT w.owner INTO head FROM {{waiters}} AS w
         WHERE w.key = p_key ORDER BY w.ticket LIMIT 1;
        IF (held_by IS NULL OR held_until < t) AND gap IS NULL
           AND (head IS NULL OR head = p_owner) THEN
            UPDATE {{table}} AS l
               SET locked_by = p_owner, locked_at = t,
                   locked_until = t + p_ttl_us * interval '1 microsecond',
                   sequence = GREATEST(l.sequence + 1, (extract(epoch FROM t) * 1000000)::bigint)
             WHERE l.key = p_key
            RETURNING l.sequence::bigint INTO fencing_token;
            DELETE FROM {{waiters}} AS w WHERE w.key = p_key AND w.owner = p_owner;
            -- Taken free, not granted: the run of grants, and any gap,
            -- are over.
            DELETE FROM {{streaks}} AS s WHERE s.key = p_key;
            RETURN;
        END IF;
        UPDATE {{waiters}} AS w
           SET alive_until = t + p_ticket_ttl_us * interval '1 microsecond', claim_us = p_claim_us
         WHERE w.key = p_key AND w.owner = p_owner;
        IF NOT FOUND THEN
            INSERT INTO {{waiters}} (key, owner, alive_until, claim_us)
            VALUES (p_key, p_owner, t + p_ticket_ttl_us * interval '1 microsecond', p_claim_us);
        END IF;
        IF head IS NULL OR head = p_owner THEN
            IF held_by IS NOT NULL AND held_until >= t THEN
                expires_us := (extract(epoch FROM (held_until - t)) * 1000000)::bigint;
            ELSIF gap IS NOT NULL THEN
                expires_us := (extract(epoch FROM (gap - t)) * 1000000)::bigint;
            END IF;
        END IF;
        last_token := fence;
    END
    {{body}};
EXCEPTION WHEN duplicate_function THEN NULL;
END
{{do}};

DO {{do}}
BEGIN
    -- 0002's release, and the gap: a grant that would continue a run of
    -- grants begun 10 s or more before is not made; the row is freed,
    -- nobody is told, the head keeps its place, and the key is left free
    -- for 600 ms (the runs table's `gap_until`). Every grant records the
    -- run: its start (now, unless the holder is the run's last grantee)
    -- and the grant's fencing token.
    CREATE FUNCTION {{release_v2}}(p_key text, p_owner text, p_channel text, p_grant_channel text)
    RETURNS boolean LANGUAGE plpgsql VOLATILE AS {{body}}
    DECLARE
        t timestamp without time zone;
        held_until timestamp without time zone;
        held_token bigint;
        head_owner text;
        head_claim bigint;
        fence bigint;
        run_began timestamp without time zone;
        run_token bigint;
    BEGIN
        SELECT l.locked_until, l.sequence INTO held_until, held_token FROM {{table}} AS l
         WHERE l.key = p_key AND l.locked_by = p_owner FOR UPDATE;
        IF NOT FOUND THEN
            RETURN NULL;
        END IF;
        t := clock_timestamp() AT TIME ZONE 'UTC';
        IF held_until >= t THEN
            SELECT w.owner, w.claim_us INTO head_owner, head_claim FROM {{waiters}} AS w
             WHERE w.key = p_key AND w.alive_until >= t ORDER BY w.ticket LIMIT 1;
            IF FOUND THEN
                SELECT s.began, s.last_token INTO run_began, run_token FROM {{streaks}} AS s
                 WHERE s.key = p_key;
                IF run_token IS DISTINCT FROM held_token OR run_began IS NULL THEN
                    run_began := t;
                ELSIF t - run_began >= interval '10 seconds' THEN
                    UPDATE {{streaks}} AS s
                       SET began = NULL, last_token = NULL, gap_until = t + interval '600 milliseconds'
                     WHERE s.key = p_key;
                    UPDATE {{table}} AS l SET locked_by = NULL WHERE l.key = p_key;
                    RETURN true;
                END IF;
                UPDATE {{table}} AS l
                   SET locked_by = head_owner, locked_at = t,
                       locked_until = t + head_claim * interval '1 microsecond',
                       sequence = GREATEST(l.sequence + 1, (extract(epoch FROM t) * 1000000)::bigint)
                 WHERE l.key = p_key
                RETURNING l.sequence::bigint INTO fence;
                DELETE FROM {{waiters}} AS w WHERE w.key = p_key AND w.owner = head_owner;
                INSERT INTO {{streaks}} AS s (key, began, last_token) VALUES (p_key, run_began, fence)
                ON CONFLICT (key) DO UPDATE
                SET began = excluded.began, last_token = excluded.last_token, gap_until = NULL;
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
    -- 0002's leave, handing an untaken grant on through the release above.
    CREATE FUNCTION {{leave_v2}}(p_key text, p_owner text, p_channel text, p_grant_channel text)
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
            PERFORM {{release_v2}}(p_key, p_owner, p_channel, p_grant_channel);
        ELSIF (held_by IS NULL OR held_until < t)
              AND EXISTS (SELECT 1 FROM {{waiters}} AS w WHERE w.key = p_key AND w.alive_until >= t) THEN
            PERFORM pg_notify(p_channel, p_key);
        END IF;
    END
    {{body}};
EXCEPTION WHEN duplicate_function THEN NULL;
END
{{do}};
