//! What the test files share: configs and backends on the test servers'
//! etcd members (`withlock_test_servers::etcd::EtcdCluster`), which give
//! their endpoints and know nothing of this crate.
#![allow(dead_code, unreachable_pub)]

use std::time::Duration;

use lock_etcd::{EtcdBackend, EtcdConfig};
use tokio::io::AsyncBufReadExt;
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

/// How long `etcdctl` is given to take a name or to exit.
const ETCDCTL_SOON: Duration = Duration::from_secs(10);

/// `etcdctl lock NAME`, running; it prints its key once it holds the name.
pub struct Etcdctl {
    child: tokio::process::Child,
    lines: tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
}

impl Etcdctl {
    pub fn start(cluster: &EtcdCluster, name: &str) -> Self {
        let mut command = tokio::process::Command::from(cluster.etcdctl());
        let mut child = command
            .arg("lock")
            .arg(name)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("etcdctl starts");
        let lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
        Self { child, lines }
    }

    /// Waits until it holds the name; gives the key it printed.
    pub async fn held(&mut self) -> String {
        tokio::time::timeout(ETCDCTL_SOON, self.lines.next_line())
            .await
            .expect("etcdctl takes the lock")
            .unwrap()
            .expect("etcdctl printed its key")
    }

    /// Asserts that it takes nothing for `for_`.
    pub async fn holds_nothing_for(&mut self, for_: Duration) {
        assert!(
            tokio::time::timeout(for_, self.lines.next_line())
                .await
                .is_err(),
            "etcdctl took the name out of turn"
        );
    }

    /// Stops it with SIGTERM: it unlocks, then exits.
    pub async fn stop(mut self) {
        let pid = self.child.id().unwrap();
        let status = std::process::Command::new("kill")
            .arg("-TERM")
            .arg(pid.to_string())
            .status()
            .unwrap();
        assert!(status.success());
        tokio::time::timeout(ETCDCTL_SOON, self.child.wait())
            .await
            .expect("etcdctl exits after SIGTERM")
            .unwrap();
    }
}
