//! The whole conformance suite against PostgreSQL (`DATABASE_URL`, default
//! `postgres://postgres@127.0.0.1:5432/test`).
//!
//! Each case gets a backend on a pool of its own (a pool must not outlive
//! the case's runtime) with its lock table in a schema of its own. The
//! schema is dropped when the last locker of the case lets go of the
//! backend, from a helper thread with its own runtime, since the case's
//! runtime is shutting down by then; a schema that could not be dropped
//! (a killed run) is dropped by the first case of a later run once it is
//! an hour old. See `lock_postgres::testing`.

use lock_postgres::testing::{database_url, TestBackend};

lock_conformance::conformance_tests!(|| async {
    TestBackend::new(&database_url())
        .await
        .expect("a test backend on DATABASE_URL")
});
