-- The lock table: one row per key, with Ruby Locker's columns.
--
-- The table placeholder (`table` in double braces) is replaced by the
-- schema-qualified table name, each part quoted as an identifier. (No
-- comment holds a placeholder: the name put in its place may hold a line
-- break, which would end the comment.) The backend runs this file inside a
-- transaction that holds a transaction-scoped advisory lock, so two nodes
-- migrating at once do not race. Idempotent: running it again changes
-- nothing.
--
-- Times are `timestamp without time zone` in UTC, as Ruby Locker writes them
-- (`clock_timestamp() at time zone 'UTC'`), so both can share the table.
-- `id` is there so that an ActiveRecord model maps the table as Locker's
-- generator makes it; withlock never reads it.
CREATE TABLE IF NOT EXISTS {{table}} (
    id           bigserial PRIMARY KEY,
    key          text NOT NULL UNIQUE,
    locked_by    text,
    locked_at    timestamp without time zone,
    locked_until timestamp without time zone,
    sequence     bigint NOT NULL DEFAULT 0
);
