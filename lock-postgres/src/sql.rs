//! The statements of the lock steps, one autocommit statement each.
//!
//! Every time comes from the database (`clock_timestamp()`, read once per
//! statement in the `now` CTE), in UTC without a time zone as Ruby Locker
//! writes it. The client sends only the key, the owner token and the ttl as
//! a number of microseconds, never a timestamp.

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
/// standing for the quoted, schema-qualified table name.
pub(crate) const MIGRATIONS: &[(&str, &str)] = &[(
    "0001_create_locks.sql",
    include_str!("../migrations/0001_create_locks.sql"),
)];

/// The statements for one table, built once per backend.
#[derive(Clone, Debug)]
pub(crate) struct Statements {
    /// `$1` key, `$2` owner, `$3` ttl in µs. Returns `sequence`, the
    /// fencing token, when taken, no row when busy.
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
    /// `$1` key, `$2` owner, and `$3` channel when notifications are on.
    /// Returns one row, `held` (whether the lease was still valid), when
    /// `locked_by` was ours; no row otherwise.
    pub(crate) release: String,
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
    pub(crate) fn new(table: &str, notify: bool) -> Self {
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
        let acquire = format!(
            "{NOW} \
             INSERT INTO {table} AS l (key, locked_by, locked_at, locked_until, sequence) \
             SELECT $1, $2, now.t, now.t + $3::bigint * interval '1 microsecond', now.us \
             FROM now \
             ON CONFLICT (key) DO UPDATE \
             SET locked_by = excluded.locked_by, locked_at = excluded.locked_at, \
                 locked_until = excluded.locked_until, \
                 sequence = GREATEST(l.sequence + 1, excluded.sequence) \
             WHERE l.locked_by IS NULL OR l.locked_until < excluded.locked_at \
             RETURNING l.sequence::bigint"
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
        let release = format!(
            "{NOW}, \
             released AS (UPDATE {table} AS l SET locked_by = NULL FROM now \
                          WHERE l.key = $1 AND l.locked_by = $2 \
                          RETURNING l.key, l.locked_until >= now.t AS held) \
             SELECT r.held{announce} FROM released AS r"
        );
        Self {
            acquire,
            extend,
            hold,
            hold_unrecorded,
            release,
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
