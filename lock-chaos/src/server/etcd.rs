//! The etcd lock server of a run: a 3-member cluster of
//! [`withlock_test_servers::etcd::EtcdCluster`] (heartbeat 10 ms, election timeout
//! 100 ms), its member faults, and the config every client of a run uses.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lock_etcd::{EtcdBackend, EtcdConfig};
use withlock_test_servers::etcd::EtcdCluster;

use super::{blocking, Injected, ServerError};
use crate::event::FaultKind;

/// How long the members may take to agree on a leader after a fault.
const LEADER_WAIT: Duration = Duration::from_secs(20);

/// The config of the workers and the leak check on the members of `url`
/// (`etcd://host:port,…`): a 1 s step timeout, as the lock-etcd fault
/// tests use, so that a step sent to a stopped member fails over soon.
///
/// # Errors
///
/// When the URL does not parse.
pub fn config(url: &str) -> Result<EtcdConfig, lock_etcd::SetupError> {
    Ok(EtcdConfig::from_url(url)?
        .step_timeout(Duration::from_secs(1))
        .connect_timeout(Duration::from_secs(5)))
}

/// A backend on the members of `url`, with [`config`].
///
/// # Errors
///
/// When the URL does not parse or no member answers in time.
pub async fn connect(url: &str) -> Result<EtcdBackend, lock_etcd::SetupError> {
    EtcdBackend::connect(config(url)?).await
}

/// Three etcd members. Dropping it kills them (SIGKILL, which a stopped
/// member obeys too).
#[derive(Debug)]
pub struct EtcdServer {
    cluster: Arc<EtcdCluster>,
    /// Turns over the followers a fault picks.
    next_follower: AtomicUsize,
}

impl EtcdServer {
    pub(super) async fn start() -> Result<Self, ServerError> {
        Ok(Self {
            cluster: Arc::new(EtcdCluster::start(3).await?),
            next_follower: AtomicUsize::new(0),
        })
    }

    pub(super) fn url(&self) -> String {
        self.cluster.url()
    }

    /// Kills or stops the leader or a follower for `down_for`, brings it
    /// back and waits until the members agree on a leader again.
    pub(super) async fn inject(
        &self,
        kind: FaultKind,
        down_for: Duration,
    ) -> Result<Injected, ServerError> {
        let leader = self.cluster.wait_for_leader(LEADER_WAIT).await?;
        let member = match kind {
            FaultKind::LeaderKill | FaultKind::LeaderStop => leader,
            FaultKind::FollowerKill | FaultKind::FollowerStop => {
                let followers: Vec<usize> =
                    (0..self.cluster.len()).filter(|&i| i != leader).collect();
                followers[self.next_follower.fetch_add(1, Ordering::Relaxed) % followers.len()]
            }
            other => {
                return Err(ServerError::Io(std::io::Error::other(format!(
                    "{} is not an etcd fault",
                    other.name()
                ))))
            }
        };
        let role = if member == leader {
            "leader"
        } else {
            "follower"
        };
        let what = match kind {
            FaultKind::LeaderKill | FaultKind::FollowerKill => {
                let c = Arc::clone(&self.cluster);
                blocking(move || {
                    c.kill(member);
                    Ok(())
                })
                .await?;
                tokio::time::sleep(down_for).await;
                let c = Arc::clone(&self.cluster);
                blocking(move || Ok(c.restart(member)?)).await?;
                "killed (SIGKILL) and restarted on its data"
            }
            _ => {
                self.cluster.pause(member)?;
                tokio::time::sleep(down_for).await;
                self.cluster.resume(member)?;
                "stopped (SIGSTOP), then resumed"
            }
        };
        let back = Instant::now();
        let new_leader = self.cluster.wait_for_leader(LEADER_WAIT).await?;
        Ok(Injected {
            kind: None,
            target: format!("m{member}"),
            detail: format!(
                "{role} m{member} {what} after {} ms; leader m{new_leader} {} ms later",
                down_for.as_millis(),
                back.elapsed().as_millis()
            ),
            keys: None,
        })
    }
}
