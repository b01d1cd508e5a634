//! The whole conformance suite on etcd: one single-member etcd for the
//! test process (`withlock_test_servers::etcd::shared_server`), a backend of its
//! own per case; each case's keys live in a random namespace of its own.

mod common;

use common::EtcdClusterExt;
use withlock_test_servers::etcd::shared_server;

mod with_notifications {
    use super::*;

    lock_conformance::conformance_tests!(|| async { shared_server().await.backend().await });
}
