//! The statements of the lock steps, one autocommit statement each.
//!
//! Every time comes from the database (`clock_timestamp()`, read once per
//! statement in the `now` CTE), in UTC without a time zone as Ruby Locker
//! writes it. The client sends only the key, the owner token, durations as
//! numbers of microseconds and the channels, never a timestamp.
//!
//! The fair queue's steps are functions that `migrations/0003` creates
//! (`_v2`: 0002's, with the gap of \[F5\]; each statement of one reads
//! what committed before it ran, after the function locked the key's
//! row): here they are one call each.

use crate::config::QueueNames;

/// The database's current time, read once: `t` as Ruby Locker stores it,
/// and `us`, the same instant in microseconds since the Unix epoch, the
/// clock term of the fencing token. (`extract` of a timestamp without time
/// zone counts from 1970-01-01 00:00 in that timestamp's own zone, here
/// UTC, so `us` is Unix time whatever the session's time zone.)
const NOW: &str = "WITH now AS (SELECT t, (extract(epoch FROM t) * 1000000)::bigint AS us \
                   FROM (SELECT clock_timestamp() AT TIME ZONE 'UTC' AS t) AS c)";

/// `$1` schema, `$2` table: the type of the table's `sequence` column
/// (`bigint`, `integer`, …), no row when the table or the column does not
/// exist.
pub(crate) const SEQUENCE_TYPE: &str = "SELECT format_type(a.atttypid, a.atttypmod) \
     FROM pg_attribute AS a \
     JOIN pg_class AS c ON c.oid = a.attrelid \
     JOIN pg_namespace AS n ON n.oid = c.relnamespace \
     WHERE n.nspname = $1 AND c.relname = $2 AND a.attname = 'sequence' \
       AND a.attnum > 0 AND NOT a.attisdropped";

/// The migrations shipped in `migrations/`, in order, with `{{table}}`
/// standing for the quoted, schema-qualified table name, and the fair
/// queue's names and dollar-quote tags for the others (see
/// [`render_migration`]).
pub(crate) const MIGRATIONS: &[(&str, &str)] = &[
    (
        "0001_create_locks.sql",
        include_str!("../migrations/0001_create_locks.sql"),
    ),
    (
        "0002_create_waiters.sql",
        include_str!("../migrations/0002_create_waiters.sql"),
    ),
    (
        "0003_leave_gaps.sql",
        include_str!("../migrations/0003_leave_gaps.sql"),
    ),
];

/// The text of a migration for `table` and its queue's `names`: each
/// placeholder replaced by its quoted name, and `{{do}}` and `{{body}}` by
/// dollar-quote tags that occur in none of the names (a quoted identifier
/// may hold `$`), so no name can end a quoted body. One pass over the
/// template: a name that holds `{{…}}` is put in as it is.
pub(crate) fn render_migration(text: &str, table: &str, names: &QueueNames) -> String {
    let all = [
        table,
        &names.waiters,
        &names.streaks,
        &names.queue_step,
        &names.release,
        &names.leave,
        &names.earlier[0],
        &names.earlier[1],
        &names.earlier[2],
    ];
    let tag = |base: &str| {
        (0u32..)
            .map(|n| match n {
                0 => format!("${base}$"),
                n => format!("${base}{n}$"),
            })
            .find(|tag| all.iter().all(|name| !name.contains(tag.as_str())))
            .unwrap_or_default()
    };
    let (do_tag, body_tag) = (tag("withlock_do"), tag("withlock_body"));
    let value = |placeholder: &str| match placeholder {
        "table" => Some(table),
        "waiters" => Some(names.waiters.as_str()),
        "streaks" => Some(names.streaks.as_str()),
        "queue_v1" => Some(names.earlier[0].as_str()),
        "release_v1" => Some(names.earlier[1].as_str()),
        "leave_v1" => Some(names.earlier[2].as_str()),
        "queue_v2" => Some(names.queue_step.as_str()),
        "release_v2" => Some(names.release.as_str()),
        "leave_v2" => Some(names.leave.as_str()),
        "do" => Some(do_tag.as_str()),
        "body" => Some(body_tag.as_str()),
        _ => None,
    };
    let mut out = String::with_capacity(text.len() + 1024);
    let mut rest = text;
    while let Some(start) = rest.find("{{") {
        let (before, from) = rest.split_at(start);
        out.push_str(before);
        match from[2..]
            .find("}}")
            .and_then(|end| Some((value(&from[2..2 + end])?, end)))
        {
            Some((name, end)) => {
                out.push_str(name);
                rest = &from[end + 4..];
            }
            None => {
                out.push_str("{{");
                rest = &from[2..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// The statements for one table, built once per backend.
#[derive(Clone, Debug)]
pub(crate) struct Statements {
    /// `$1` key, `$2` owner, `$3` ttl in µs. Returns one row `(sequence,
    /// expires_us)`: `sequence`, the fencing token, when taken; else the
    /// holder's time left in µs \[A9\], `NULL` when the row was not seen
    /// held (a row made or freed by a statement that committed while
    /// this one ran); no row at all in that case either.
    pub(crate) acquire: String,
    /// `$1` keys, `$2` owners, `$3` ttls in µs (arrays of equal length).
    /// Returns `(ord, outcome)` per request in order: 0 extended, 1 expired
    /// (free, expired or missing), 2 taken (another owner, not expired).
    pub(crate) extend: String,
    /// As `extend`, with `$3` the minimum hold in µs \[H7\]: `locked_until`
    /// becomes `locked_at` plus it (or now, if that has passed); and the
    /// hold's record, the row [`KEPT_PREFIX`]`<key>`, is taken for the
    /// holder until the same time, in the same statement, for the admin.
    pub(crate) hold: String,
    /// `hold` without the record, for a table whose `key` column cannot
    /// take the record's longer key (a `varchar(255)`) or that refuses its
    /// row otherwise.
    pub(crate) hold_unrecorded: String,
    /// `$1` key, `$2` owner, and, when notifications are on, `$3` channel
    /// and `$4` the grant channel. Returns one row, `held` (whether the
    /// lease was still valid), when `locked_by` was ours; no row or a
    /// `NULL` otherwise. With notifications on, a key whose queue has a
    /// live place is released by the queue's release function \[F1\],
    /// which grants it to the head (so is a lease that no longer holds
    /// the row: the function finds nothing); any other release is as
    /// [`release_plain`](Self::release_plain)'s.
    pub(crate) release: String,
    /// The release without the queue: frees the row and announces the key
    /// (`$3` channel when notifications are on). For a role without rights
    /// on the waiters table, or a table migrated before it existed \[F6\].
    pub(crate) release_plain: String,
    /// `$1` key, `$2` owner, `$3` ttl, `$4` ticket ttl and `$5` claim
    /// deadline in µs: one queued attempt \[F1\]. Returns one row
    /// `(fencing_token, expires_us, last_token)`: the first two as
    /// `acquire`'s, and, when busy, the last fencing token drawn for the
    /// key.
    pub(crate) queue_step: String,
    /// `$1` key, `$2` owner, `$3` channel, `$4` grant channel: leaves the
    /// queue, handing an untaken grant on \[F2\].
    pub(crate) leave: String,
}

/// What the key of a minimum hold's record starts with, before the
/// lock's key: the row `withlock-kept:<key>` of the lock table holds the
/// owner token of a holder whose run ended before its minimum hold
/// \[H7\], until the lock's own `locked_until`. The admin counts it only
/// while it names the lock row's holder, and does not list it as a lock
/// then.
pub const KEPT_PREFIX: &str = "withlock-kept:";

/// The outcome codes of [`Statements::extend`].
pub(crate) const EXTENDED: i32 = 0;
pub(crate) const EXPIRED: i32 = 1;
pub(crate) const TAKEN: i32 = 2;

impl Statements {
    pub(crate) fn new(table: &str, names: &QueueNames, notify: bool) -> Self {
        // A row is free when nobody holds it or its holder's time ran out
        // (Ruby Locker's `locked_until < now`). The token is
        // max(sequence + 1, database clock in µs): `+ 1` keeps it strictly
        // increasing within a microsecond, under a clock that steps back and
        // beside Ruby Locker's own `sequence + 1`; the clock keeps it
        // increasing when the row was deleted (Ruby Locker's `prune`), as a
        // new row starts at the clock (`excluded.sequence`). A column
        // narrower than bigint is refused before this statement runs; should
        // it be narrowed later, the clock value overflows it and the
        // statement fails whole, taking nothing, and the cast in RETURNING
        // keeps the answer's type fixed.
        //
        // [A9] When the row was not taken, the second branch reads it (as
        // the statement's snapshot shows it) for the holder's time left:
        // its one-time filter skips the read when the row was taken, so a
        // free key costs what it did.
        let acquire = format!(
            "{NOW}, \
             taken AS (INSERT INTO {table} AS l (key, locked_by, locked_at, locked_until, sequence) \
                       SELECT $1, $2, now.t, now.t + $3::bigint * interval '1 microsecond', now.us \
                       FROM now \
                       ON CONFLICT (key) DO UPDATE \
                       SET locked_by = excluded.locked_by, locked_at = excluded.locked_at, \
                           locked_until = excluded.locked_until, \
                           sequence = GREATEST(l.sequence + 1, excluded.sequence) \
                       WHERE l.locked_by IS NULL OR l.locked_until < excluded.locked_at \
                       RETURNING l.sequence::bigint AS sequence) \
             SELECT t.sequence, NULL::bigint AS expires_us FROM taken AS t \
             UNION ALL \
             SELECT NULL::bigint, CASE WHEN l.locked_by IS NOT NULL AND l.locked_until >= now.t \
                 THEN (extract(epoch FROM (l.locked_until - now.t)) * 1000000)::bigint END \
             FROM {table} AS l CROSS JOIN now \
             WHERE l.key = $1 AND NOT EXISTS (SELECT FROM taken)"
        );
        let extend = extension(table, "now.t + req.ttl_us * interval '1 microsecond'", "");
        // [H7] The minimum hold counts from the row's own record of the
        // acquisition; a hold already over frees the row now.
        let held_until = "GREATEST(l.locked_at + req.ttl_us * interval '1 microsecond', now.t)";
        // The hold's record: a row of the table, taken for the holder
        // until the lock's new expiry, as an acquisition takes a row (only
        // when free or expired, so a row of that name held by anyone else
        // is left alone), or written again by the same holder (a hold step
        // sent again). Its sequence stays the column's default.
        let record = format!(
            ", kept AS (INSERT INTO {table} AS m (key, locked_by, locked_at, locked_until) \
                        SELECT '{KEPT_PREFIX}' || e.key, e.locked_by, now.t, e.locked_until \
                        FROM extended AS e CROSS JOIN now \
                        ON CONFLICT (key) DO UPDATE \
                        SET locked_by = excluded.locked_by, locked_at = excluded.locked_at, \
                            locked_until = excluded.locked_until \
                        WHERE m.locked_by IS NULL OR m.locked_until < excluded.locked_at \
                           OR m.locked_by = excluded.locked_by)"
        );
        let hold = extension(table, held_until, &record);
        let hold_unrecorded = extension(table, held_until, "");
        // Release keeps the row, its sequence and its locked_until (as Ruby
        // Locker does), and announces the key in the same statement.
        // pg_notify runs once per row the select returns; its void result
        // is sent back and ignored.
        let announce = if notify { ", pg_notify($3, r.key)" } else { "" };
        let release_plain = format!(
            "{NOW}, \
             released AS (UPDATE {table} AS l SET locked_by = NULL FROM now \
                          WHERE l.key = $1 AND l.locked_by = $2 \
                          RETURNING l.key, l.locked_until >= now.t AS held) \
             SELECT r.held{announce} FROM released AS r"
        );
        // [F1] A key with a live place in its queue (as the statement's
        // snapshot shows it: one index lookup, the only cost a key without
        // a queue pays) is not released here but by the queue's release
        // function, which locks the row first and then sees what
        // committed before (see the migration): it grants the key to the
        // head. The function is called whenever the update released
        // nothing (a queue, or a lease that no longer holds the row: it
        // then finds nothing and says so). A place made while this
        // statement ran is not seen: the key is then freed and announced,
        // and that waiter, which watched before its attempt, tries again.
        let release = if notify {
            format!(
                "{NOW}, \
                 released AS (UPDATE {table} AS l SET locked_by = NULL FROM now \
                              WHERE l.key = $1 AND l.locked_by = $2 \
                                AND NOT EXISTS (SELECT FROM {waiters} AS w \
                                                WHERE w.key = $1 AND w.alive_until >= now.t) \
                              RETURNING l.key, l.locked_until >= now.t AS held) \
                 SELECT r.held, pg_notify($3, r.key)::text FROM released AS r \
                 UNION ALL \
                 SELECT {release_fn}($1, $2, $3, $4), NULL WHERE NOT EXISTS (SELECT FROM released)",
                waiters = names.waiters,
                release_fn = names.release,
            )
        } else {
            release_plain.clone()
        };
        let queue_step = format!(
            "SELECT fencing_token, expires_us, last_token FROM {}($1, $2, $3, $4, $5)",
            names.queue_step
        );
        let leave = format!("SELECT FROM {}($1, $2, $3, $4)", names.leave);
        Self {
            acquire,
            extend,
            hold,
            hold_unrecorded,
            release,
            release_plain,
            queue_step,
            leave,
        }
    }

    /// Every statement, for tests that check what the backend sends.
    pub(crate) fn all(&self) -> [&str; 4] {
        [&self.acquire, &self.extend, &self.hold, &self.release]
    }
}

/// The statement of [`Statements::extend`], setting `locked_until` to
/// `until` (an expression of `l`, the row, `req`, the request, and `now`).
/// The update touches only rows still held by the lease; the outer select
/// tells an expired or missing row from another owner's. `also`: more
/// common table expressions (from `, `), which may read `extended`.
fn extension(table: &str, until: &str, also: &str) -> String {
    format!(
        "{NOW}, \
         req AS (SELECT r.key, r.owner, r.ttl_us, r.ord \
                 FROM unnest($1::text[], $2::text[], $3::bigint[]) \
                      WITH ORDINALITY AS r(key, owner, ttl_us, ord)), \
         extended AS (UPDATE {table} AS l \
                      SET locked_until = {until} \
                      FROM req, now \
                      WHERE l.key = req.key AND l.locked_by = req.owner \
                        AND l.locked_until >= now.t \
                      RETURNING l.key, l.locked_by, l.locked_until){also} \
         SELECT req.ord, CASE \
           WHEN e.key IS NOT NULL THEN {EXTENDED} \
           WHEN l.locked_by IS NOT NULL AND l.locked_by <> req.owner \
                AND l.locked_until >= now.t THEN {TAKEN} \
           ELSE {EXPIRED} END AS outcome \
         FROM req CROSS JOIN now \
         LEFT JOIN extended AS e ON e.key = req.key AND e.locked_by = req.owner \
         LEFT JOIN {table} AS l ON l.key = req.key \
         ORDER BY req.ord"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::PostgresConfig;

    #[test]
    fn a_migration_puts_each_name_in_once_and_no_name_ends_a_body() {
        let config = PostgresConfig::default()
            .schema("s")
            .table("odd {{do}} $withlock_body$ {{table}}");
        let table = config.qualified_table().unwrap();
        let names = config.queue_names().unwrap();
        let text = render_migration(MIGRATIONS[1].1, &table, &names);
        let gaps = render_migration(MIGRATIONS[2].1, &table, &names);
        // Every placeholder of the templates is replaced, none of the
        // names' own braces.
        for placeholder in [
            "{{waiters}}",
            "{{streaks}}",
            "{{queue_v1}}",
            "{{release_v1}}",
            "{{leave_v1}}",
            "{{queue_v2}}",
            "{{release_v2}}",
            "{{leave_v2}}",
        ] {
            assert!(!text.contains(placeholder), "{placeholder}");
            assert!(!gaps.contains(placeholder), "{placeholder}");
        }
        assert!(text.contains(&names.waiters) && text.contains(&names.earlier[0]));
        assert!(gaps.contains(&names.streaks) && gaps.contains(&names.queue_step));
        assert!(gaps.contains("AS $withlock_body1$"));
        assert!(text.contains(r#""s"."odd {{do}} $withlock_body$ {{table}}""#));
        // The tags the names hold are not used: the bodies are quoted with
        // the next ones.
        assert!(!text.contains("AS $withlock_body$\n"));
        assert!(text.contains("AS $withlock_body1$"));
        assert!(text.contains("DO $withlock_do$"));
        // An ordinary table: the first tags.
        let plain = PostgresConfig::default();
        let text = render_migration(
            MIGRATIONS[1].1,
            &plain.qualified_table().unwrap(),
            &plain.queue_names().unwrap(),
        );
        assert!(text.contains(r#"CREATE FUNCTION "public"."locks_queue_v1"("#));
        assert!(text.contains("AS $withlock_body$"));
        assert!(!text.contains("{{"));
        // 0003: the runs table and the `_v2` functions; the leave calls
        // the `_v2` release.
        let gaps = render_migration(
            MIGRATIONS[2].1,
            &plain.qualified_table().unwrap(),
            &plain.queue_names().unwrap(),
        );
        assert!(gaps.contains(r#"CREATE TABLE IF NOT EXISTS "public"."locks_streaks" ("#));
        for function in ["queue_v2", "release_v2", "leave_v2"] {
            assert!(gaps.contains(&format!(r#"CREATE FUNCTION "public"."locks_{function}"("#)));
        }
        assert!(gaps.contains(r#"PERFORM "public"."locks_release_v2"("#));
        assert!(!gaps.contains("_v1") && !gaps.contains("{{"));
    }
}
