//! The whole conformance suite on etcd: one single-member etcd for the
//! test process (`lock_etcd::testing::shared_server`), a backend of its
//! own per case; each case's keys live in a random namespace of its own.

use lock_etcd::testing::shared_server;

mod with_notifications {
    use super::*;

    lock_conformance::conformance_tests!(|| async { shared_server().await.backend().await });
}
