//! Following the Sentinels' own announcements, as Redis's guidelines for
//! Sentinel clients ask: a background task subscribes to `+switch-master`
//! on every configured Sentinel (with their credentials, reconnecting with
//! backoff), and reads what each names for the master (`SENTINEL
//! GET-MASTER-ADDR-BY-NAME`) when it connects and at every health-check
//! interval, in case an announcement was missed.
//!
//! Why: a primary stopped (not dead: `SIGSTOP`, a long pause) until its
//! replica was promoted, and then resumed, still says it is the master and
//! takes writes until the Sentinels demote it, about 10 s later (their
//! `INFO` period). A backend that asks the Sentinels again only after a
//! broken connection or a `READONLY` answer keeps granting locks there in
//! that window, beside the new primary. Here, as soon as a majority of the
//! configured Sentinels name a new primary, the backend's connections are
//! dropped, the release subscription is made again, and every connection
//! made from then on goes to the primary that majority names.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures_util::StreamExt;
use lock_core::{BackendError, BackendErrorKind};
use redis::ConnectionInfo;
use tokio::sync::watch;

use crate::cluster_nodes::Node;
use crate::plumbing::errors::map_redis_error;
use crate::plumbing::task::{ticker, FIRST_RECONNECT_DELAY};
use crate::plumbing::timeout::within;

/// The channel the Sentinels announce a failover's end on.
const SWITCH_MASTER: &str = "+switch-master";

/// What the configured Sentinels name for the master, and what the
/// backend follows.
pub(crate) struct Announcements {
    master_name: String,
    /// Per configured Sentinel, in order: the master it named last, `None`
    /// while it is not reached.
    named: Mutex<Vec<Option<Node>>>,
    /// The master a majority of the configured Sentinels name now.
    agreed: watch::Sender<Option<Node>>,
    /// Counts the times a majority named a master other than the one the
    /// backend's connections go to: each drops them.
    switches: watch::Sender<u64>,
    /// The master the last connection was made to, as the backend looked
    /// it up.
    followed: Mutex<Option<Node>>,
}

impl Announcements {
    pub(crate) fn new(master_name: &str, sentinels: usize) -> Self {
        Self {
            master_name: master_name.to_owned(),
            named: Mutex::new(vec![None; sentinels]),
            agreed: watch::channel(None).0,
            switches: watch::channel(0).0,
            followed: Mutex::new(None),
        }
    }

    /// The master a majority of the configured Sentinels name now, if they
    /// agree.
    pub(crate) fn agreed(&self) -> Option<Node> {
        self.agreed.borrow().clone()
    }

    /// Changes each time the backend must drop its connections.
    pub(crate) fn switches(&self) -> u64 {
        *self.switches.borrow()
    }

    /// Changes each time the backend must drop its connections.
    pub(crate) fn switch_changes(&self) -> watch::Receiver<u64> {
        self.switches.subscribe()
    }

    /// The backend's connections now go to `node`.
    pub(crate) fn following(&self, node: Node) {
        *self.followed.lock().unwrap_or_else(PoisonError::into_inner) = Some(node);
    }

    /// Sentinel `i` names `node` now (`None`: it is not reached).
    fn named(&self, i: usize, node: Option<Node>) {
        let agreed = {
            let mut named = self.named.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(slot) = named.get_mut(i) {
                *slot = node;
            }
            majority(&named)
        };
        let changed = self.agreed.send_if_modified(|now| {
            if *now == agreed {
                return false;
            }
            *now = agreed.clone();
            true
        });
        let Some(master) = agreed.filter(|_| changed) else {
            return;
        };
        let mut followed = self.followed.lock().unwrap_or_else(PoisonError::into_inner);
        if followed.as_ref() != Some(&master) {
            tracing::info!(
                master_name = %self.master_name,
                to = %format!("{}:{}", master.0, master.1),
                from = ?followed.as_ref().map(|(h, p)| format!("{h}:{p}")),
                "a majority of the Sentinels name another primary: following it"
            );
            *followed = Some(master);
            self.switches.send_modify(|n| *n += 1);
        }
    }
}

/// The node named by more than half of `named` (all the configured
/// Sentinels, reached or not).
fn majority(named: &[Option<Node>]) -> Option<Node> {
    let needed = named.len() / 2 + 1;
    named.iter().flatten().find_map(|candidate| {
        (named.iter().flatten().filter(|n| *n == candidate).count() >= needed)
            .then(|| candidate.clone())
    })
}

/// How the task reaches the Sentinels.
pub(crate) struct Sentinels {
    /// One connection info per Sentinel, with their credentials and TLS.
    pub(crate) infos: Vec<ConnectionInfo>,
    pub(crate) timeout: Duration,
    pub(crate) health_check_interval: Duration,
    pub(crate) max_reconnect_delay: Duration,
}

/// Follows every Sentinel at once, until dropped.
pub(crate) async fn follow(announcements: Arc<Announcements>, sentinels: Sentinels) {
    let followers = sentinels
        .infos
        .iter()
        .enumerate()
        .map(|(i, info)| follow_one(&announcements, &sentinels, i, info));
    futures_util::future::join_all(followers).await;
}

/// Follows Sentinel `i` at `info`, reconnecting with backoff.
async fn follow_one(
    announcements: &Announcements,
    sentinels: &Sentinels,
    i: usize,
    info: &ConnectionInfo,
) {
    let mut delay = FIRST_RECONNECT_DELAY;
    loop {
        let mut connected = false;
        let why = listen(announcements, sentinels, i, info, &mut connected).await;
        announcements.named(i, None);
        if connected {
            delay = FIRST_RECONNECT_DELAY;
        }
        tracing::debug!(sentinel = %info.addr, error = %lock_core::ErrorChain(&why), ?delay, "Sentinel announcements lost; reconnecting");
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(sentinels.max_reconnect_delay);
    }
}

/// Subscribes to `+switch-master` on Sentinel `i`, reads what it names,
/// then hands on its announcements until the connection fails; says why.
async fn listen(
    announcements: &Announcements,
    sentinels: &Sentinels,
    i: usize,
    info: &ConnectionInfo,
    connected: &mut bool,
) -> BackendError {
    let timeout = sentinels.timeout;
    let made = within("connecting to a Sentinel", timeout, async {
        let client = redis::Client::open(info.clone()).map_err(map_redis_error)?;
        let mut pubsub = client.get_async_pubsub().await.map_err(map_redis_error)?;
        pubsub
            .subscribe(SWITCH_MASTER)
            .await
            .map_err(map_redis_error)?;
        let conn = client
            .get_multiplexed_async_connection()
            .await
            .map_err(map_redis_error)?;
        Ok::<_, BackendError>((pubsub, conn))
    })
    .await;
    let (pubsub, mut conn) = match made {
        Ok(made) => made,
        Err(error) => return error,
    };
    *connected = true;
    let (mut sink, mut messages) = pubsub.split();
    // The first tick at once: what the Sentinel names now, which the
    // subscription (in place first) keeps up to date.
    let mut health = ticker(sentinels.health_check_interval);
    loop {
        tokio::select! {
            message = messages.next() => {
                let Some(message) = message else {
                    return BackendError::message(
                        BackendErrorKind::Request,
                        "the Sentinel's subscription connection closed",
                    );
                };
                let payload: String = message.get_payload().unwrap_or_default();
                if let Some(to) = switched_to(&payload, &announcements.master_name) {
                    tracing::debug!(sentinel = %info.addr, %payload, "+switch-master");
                    announcements.named(i, Some(to));
                }
            }
            _ = health.tick() => {
                let checked = within("asking a Sentinel", timeout, async {
                    sink.ping::<redis::Value>().await.map_err(map_redis_error)?;
                    redis::cmd("SENTINEL")
                        .arg("GET-MASTER-ADDR-BY-NAME")
                        .arg(&announcements.master_name)
                        .query_async::<Option<(String, u16)>>(&mut conn)
                        .await
                        .map_err(map_redis_error)
                })
                .await;
                match checked {
                    Ok(named) => announcements.named(i, named),
                    Err(error) => return error,
                }
            }
        }
    }
}

/// The new master of `master_name` in a `+switch-master` message
/// (`<name> <old ip> <old port> <new ip> <new port>`).
fn switched_to(payload: &str, master_name: &str) -> Option<Node> {
    let mut fields = payload.split(' ');
    if fields.next()? != master_name {
        return None;
    }
    let (_old_ip, _old_port) = (fields.next()?, fields.next()?);
    let host = fields.next()?.to_owned();
    let port = fields.next()?.parse().ok()?;
    Some((host, port))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(port: u16) -> Option<Node> {
        Some(("10.0.0.1".to_owned(), port))
    }

    #[test]
    fn a_majority_of_the_configured_sentinels_names_the_master() {
        assert_eq!(majority(&[node(1), node(1), None]), node(1));
        assert_eq!(majority(&[node(1), node(2), None]), None);
        assert_eq!(majority(&[node(1), None, None]), None);
        assert_eq!(majority(&[node(2), node(1), node(2)]), node(2));
        assert_eq!(majority(&[node(1)]), node(1));
        assert_eq!(majority(&[node(1), node(2)]), None);
    }

    #[test]
    fn a_switch_names_the_new_master_of_its_name_only() {
        let payload = "mymaster 10.0.0.1 6379 10.0.0.2 6380";
        assert_eq!(
            switched_to(payload, "mymaster"),
            Some(("10.0.0.2".to_owned(), 6380))
        );
        assert_eq!(switched_to(payload, "other"), None);
        assert_eq!(switched_to("mymaster 10.0.0.1", "mymaster"), None);
    }

    #[test]
    fn only_a_new_master_switches() {
        let a = Announcements::new("m", 3);
        a.following(("10.0.0.1".to_owned(), 1));
        a.named(0, node(1));
        a.named(1, node(1));
        assert_eq!(a.agreed(), node(1));
        assert_eq!(a.switches(), 0, "the master followed already");
        a.named(0, node(2));
        assert_eq!(a.switches(), 0, "one Sentinel is no majority");
        a.named(2, node(2));
        assert_eq!(a.agreed(), node(2));
        assert_eq!(a.switches(), 1);
        a.named(1, node(2));
        assert_eq!(a.switches(), 1);
    }
}
