//! Concurrent acquisitions and releases on a cluster, batched per master,
//! as the single-node backend batches them ([`crate::batch`], the same
//! [`Batcher`] rules): a step goes out alone while few of its kind are on
//! the wire to its master; beyond that it waits, and the steps waiting for
//! one master go out together as one pipeline on that master's connection
//! (one write, one round trip), one script call per step. A batch script
//! over all their keys, as the single node sends, is not possible here:
//! the keys are in different slots, and a script may touch one slot only.
//!
//! A step whose answer in the batch is a redirection or `NOSCRIPT` (its
//! slot moved, the node lost its scripts) is sent again on its own, routed
//! and loaded: such an answer means it did not run. A batch is sent by a
//! task of its own, so a caller that is dropped while it waits changes
//! nothing for the others. A batch that fails (its master is unreachable
//! or hung) fails every step in it, and only those: each master has its
//! own batchers.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use lock_core::{BackendError, BackendErrorKind};
use redis::Value;
use tokio::sync::oneshot;

use crate::batch::{fail_dropped, spawn_or_drop, Batcher, Queued};
use crate::cluster::{needs_routing, RedisClusterBackend};
use crate::cluster_nodes::{Lane, Node};

/// The two kinds of step that go out in batches under load.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Kind {
    Acquisition,
    Release,
}

impl Kind {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Acquisition => "acquisition",
            Self::Release => "release",
        }
    }
}

/// The batchers of every master, made on first use.
#[derive(Default)]
pub(crate) struct Batchers {
    masters: Mutex<HashMap<Node, OfMaster>>,
}

/// The two batchers of one master.
#[derive(Default)]
struct OfMaster {
    acquisitions: Arc<Batcher>,
    releases: Arc<Batcher>,
}

impl Batchers {
    /// How many masters have batchers, and the steps queued in all of them.
    pub(crate) fn counts(&self) -> (usize, usize) {
        let masters = self.masters.lock().unwrap_or_else(PoisonError::into_inner);
        let queued = masters
            .values()
            .map(|m| m.acquisitions.queued() + m.releases.queued())
            .sum();
        (masters.len(), queued)
    }

    fn get(&self, master: &Node, kind: Kind) -> Arc<Batcher> {
        let mut masters = self.masters.lock().unwrap_or_else(PoisonError::into_inner);
        // Looked up before it is made: no key is copied on every step.
        let of_master = match masters.get(master) {
            Some(of_master) => of_master,
            None => masters.entry(master.clone()).or_default(),
        };
        Arc::clone(match kind {
            Kind::Acquisition => &of_master.acquisitions,
            Kind::Release => &of_master.releases,
        })
    }
}

/// A step of `kind` for `master`: alone while the wire to it has room,
/// else in the next batch to it. Its answer, an error reply as an error.
pub(crate) async fn step(
    backend: &RedisClusterBackend,
    batchers: &Batchers,
    master: Node,
    kind: Kind,
    keys: Vec<String>,
    args: Vec<String>,
) -> Result<Value, BackendError> {
    let batcher = batchers.get(&master, kind);
    if batcher.go_alone() {
        let _counted = OnTheWire {
            backend,
            batcher: Arc::clone(&batcher),
            master,
            kind,
        };
        let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        return backend
            .eval(kind.name(), Lane::Steps, kind.lua(), &keys, &args)
            .await;
    }
    let (answer, answered) = oneshot::channel();
    if let Some(batch) = batcher.queue(Queued { keys, args, answer }) {
        send_batch(backend, batcher, master, kind, batch);
    }
    backend
        .bounded(kind.name(), async {
            answered.await.unwrap_or_else(|_| {
                Err(BackendError::message(
                    BackendErrorKind::Request,
                    "the batch this step went out in was dropped before its answer (the runtime is shutting down)",
                ))
            })
        })
        .await
}

/// A step going out alone: counted on the wire until dropped (also when
/// its caller is dropped first), then the next batch goes out.
struct OnTheWire<'a> {
    backend: &'a RedisClusterBackend,
    batcher: Arc<Batcher>,
    master: Node,
    kind: Kind,
}

impl Drop for OnTheWire<'_> {
    fn drop(&mut self) {
        if let Some(batch) = self.batcher.finished() {
            send_batch(
                self.backend,
                Arc::clone(&self.batcher),
                self.master.clone(),
                self.kind,
                batch,
            );
        }
    }
}

/// Sends `batch` (counted on the wire) as one pipeline to `master`, in a
/// task of its own, and hands each step its answer.
fn send_batch(
    backend: &RedisClusterBackend,
    batcher: Arc<Batcher>,
    master: Node,
    kind: Kind,
    batch: Vec<Queued>,
) {
    let counted = BatchOnTheWire {
        backend: backend.clone(),
        batcher,
        master,
        kind,
        batch,
    };
    spawn_or_drop(counted.send());
}

/// A batch on the wire. Dropped before its answer (its task cancelled, or
/// no runtime to send it on), its steps get an error and it counts out.
struct BatchOnTheWire {
    backend: RedisClusterBackend,
    batcher: Arc<Batcher>,
    master: Node,
    kind: Kind,
    batch: Vec<Queued>,
}

impl BatchOnTheWire {
    async fn send(mut self) {
        let backend = self.backend.clone();
        let lua = self.kind.lua();
        let mut pipe = redis::Pipeline::with_capacity(self.batch.len());
        for queued in &self.batch {
            let (keys, args) = queued.keys_and_args();
            lua.add_call(&mut pipe, &keys, &args);
        }
        let n = self.batch.len();
        let sent = backend
            .bounded(
                self.kind.name(),
                backend.nodes().send(&self.master, Lane::Steps, &pipe, 0, n),
            )
            .await;
        let batch = std::mem::take(&mut self.batch);
        match sent {
            Ok(values) => {
                let mut again = Vec::new();
                for (queued, value) in batch.into_iter().zip(values) {
                    if needs_routing(&value) {
                        again.push(queued);
                    } else {
                        let _ = queued.answer.send(backend.answer(Some(value)));
                    }
                }
                // Did not run where it was sent: sent again on its own.
                let kind = self.kind;
                let each = again.into_iter().map(|queued| {
                    let backend = &backend;
                    async move {
                        let (keys, args) = queued.keys_and_args();
                        let answer = backend
                            .eval(kind.name(), Lane::Steps, lua, &keys, &args)
                            .await;
                        let _ = queued.answer.send(answer);
                    }
                });
                futures_util::future::join_all(each).await;
            }
            Err(error) => {
                for queued in batch {
                    let _ = queued.answer.send(Err(error.clone()));
                }
            }
        }
    }
}

impl Drop for BatchOnTheWire {
    fn drop(&mut self) {
        fail_dropped(&mut self.batch);
        if let Some(next) = self.batcher.finished() {
            send_batch(
                &self.backend,
                Arc::clone(&self.batcher),
                self.master.clone(),
                self.kind,
                next,
            );
        }
    }
}
