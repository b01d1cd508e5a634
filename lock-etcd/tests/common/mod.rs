//! What the test files share: configs and backends on the test servers'
//! etcd members (`withlock_test_servers::etcd::EtcdCluster`), which give
//! their endpoints and know nothing of this crate.
#![allow(dead_code, unreachable_pub)]

use std::time::Duration;

use lock_etcd::{EtcdBackend, EtcdConfig};
use withlock_test_servers::etcd::EtcdCluster;

/// This crate's configs and backends on a test cluster's members.
pub trait EtcdClusterExt {
    /// A config on every member (member 0 first, so the one in use),
    /// with short timeouts so that a backend on a stopped member fails
    /// over soon: a step timeout of 1 s and a failover timeout of 300 ms.
    fn config(&self) -> EtcdConfig;

    /// [`config`](Self::config) with the members in the order `first`,
    /// `first + 1`, …: member `first` is the one the backend uses until
    /// it fails.
    fn config_from(&self, first: usize) -> EtcdConfig;

    /// [`config`](Self::config) as the user `name` of
    /// [`EtcdCluster::add_user`] (password `<name>-pw`; `root` for
    /// [`EtcdCluster::enable_auth`]'s root). Logging in costs a bcrypt
    /// hash on the server, slow on a loaded machine, so the failover
    /// timeout (which bounds a login) and the step timeout are 2 s, and
    /// the connect timeout 20 s.
    fn user_config(&self, name: &str) -> EtcdConfig;

    /// A backend on every member with [`config`](Self::config).
    ///
    /// # Panics
    ///
    /// When it cannot connect.
    async fn backend(&self) -> EtcdBackend;
}

impl EtcdClusterExt for EtcdCluster {
    fn config(&self) -> EtcdConfig {
        self.config_from(0)
    }

    fn config_from(&self, first: usize) -> EtcdConfig {
        let n = self.len();
        EtcdConfig::new((0..n).map(|i| self.endpoint((first + i) % n)))
            .step_timeout(Duration::from_secs(1))
            .failover_timeout(Duration::from_millis(300))
            .connect_timeout(Duration::from_secs(5))
    }

    fn user_config(&self, name: &str) -> EtcdConfig {
        self.config()
            .user(name, format!("{name}-pw"))
            .step_timeout(Duration::from_secs(2))
            .failover_timeout(Duration::from_secs(2))
            .connect_timeout(Duration::from_secs(20))
    }

    async fn backend(&self) -> EtcdBackend {
        EtcdBackend::connect(self.config())
            .await
            .unwrap_or_else(|e| panic!("no backend on the test etcd: {e:?}"))
    }
}
