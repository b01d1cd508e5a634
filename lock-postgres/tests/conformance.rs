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

//!
//! The cases' ttls are at least 1 s here ([`lock_conformance::with_min_ttl`]):
//! every statement waits for a commit, and on a busy machine the suite's
//! 400 ms ttl left an extension too little time to arrive. The backend's
//! sub-second ttls are covered by its own tests (`faults.rs`, `batch.rs`).

use std::time::Duration;

use lock_postgres::testing::TestBackend;
use withlock_test_servers::postgres::database_url;

lock_conformance::conformance_tests!(lock_conformance::with_min_ttl(
    Duration::from_secs(1),
    || async {
        TestBackend::new(&database_url())
            .await
            .expect("a test backend on DATABASE_URL")
    }
));
