//! Concurrent steps of one kind sent as one script run.
//!
//! A step goes out on its own while fewer than [`MAX_IN_FLIGHT`] of its
//! kind are on the wire and none is waiting, so a lone caller (or two) pays
//! nothing for this. Beyond that it waits in a queue, which goes out (up to
//! [`MAX_BATCH`] steps) as one batch script run when one of those on the
//! wire answers, or at once when [`FULL_BATCH`] steps wait and fewer than
//! [`MAX_IN_FLIGHT_FULL`] requests are on the wire. Under load the server
//! then runs one script, not one per step, and every command's fixed cost
//! (reading and parsing it, looking up and starting the script, writing
//! the answer) is paid once per batch. That cost is most of a lock step's,
//! and the server is what limits many callers on one Redis: with 64 tasks
//! on one backend, the server's CPU per lock cycle falls by a quarter to
//! a third (`bench_redis p2`).
//!
//! A batch is sent by a task of its own, so a caller that is dropped while
//! it waits changes nothing for the others; its answer is then dropped too
//! (a dropped step may have taken its key, as the trait says). A batch
//! that fails fails every step in it, with the same error.

use std::sync::{Mutex, MutexGuard, PoisonError};

use lock_core::BackendError;
use tokio::sync::oneshot;

/// How many requests of one kind may be on the wire before the next ones
/// wait to go out together.
pub(crate) const MAX_IN_FLIGHT: usize = 2;

/// A queue this long goes out at once, without waiting for an answer,
/// while fewer than [`MAX_IN_FLIGHT_FULL`] requests of its kind are on the
/// wire: a batch this big is worth a request of its own, and the server is
/// kept busy. (Tuned on `bench_redis p2`: 2 / 8 / 8 gave the most cycles
/// per second; 4 on the wire before batching made batches too small.)
pub(crate) const FULL_BATCH: usize = 8;
/// See [`FULL_BATCH`].
pub(crate) const MAX_IN_FLIGHT_FULL: usize = 8;

/// The most steps in one batch script run.
pub(crate) const MAX_BATCH: usize = 64;

/// A step waiting in the queue: its script keys and arguments, and where
/// its answer goes.
pub(crate) struct Queued {
    pub(crate) keys: Vec<String>,
    pub(crate) args: Vec<String>,
    pub(crate) answer: oneshot::Sender<Result<redis::Value, BackendError>>,
}

impl Queued {
    /// The step's script keys and arguments, as the script call takes them.
    pub(crate) fn keys_and_args(&self) -> (Vec<&str>, Vec<&str>) {
        (
            self.keys.iter().map(String::as_str).collect(),
            self.args.iter().map(String::as_str).collect(),
        )
    }
}

/// Fails every step of a batch dropped before its answer (its task
/// cancelled, or no runtime to send it on).
pub(crate) fn fail_dropped(batch: &mut Vec<Queued>) {
    for queued in batch.drain(..) {
        let _ = queued.answer.send(Err(BackendError::message(
            lock_core::BackendErrorKind::Request,
            "the batch this step went out in was dropped before its answer",
        )));
    }
}

/// Sends a batch in a task of its own. Outside a runtime nothing can go
/// out: the task is dropped unsent, and the batch it owns fails its steps
/// as it is dropped, and so on for the queue behind it.
pub(crate) fn spawn_or_drop(send: impl std::future::Future<Output = ()> + Send + 'static) {
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => {
            runtime.spawn(send);
        }
        Err(_) => drop(send),
    }
}

/// The requests of one kind on the wire, and the steps waiting.
#[derive(Default)]
pub(crate) struct Batcher {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    in_flight: usize,
    queue: Vec<Queued>,
}

impl Batcher {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Counts a step in as going out alone, if it may: then the caller
    /// must call [`finished`](Self::finished) once it is answered (or
    /// dropped).
    /// How many steps wait to go out in the next batch.
    pub(crate) fn queued(&self) -> usize {
        self.state().queue.len()
    }

    pub(crate) fn go_alone(&self) -> bool {
        let mut state = self.state();
        if state.in_flight < MAX_IN_FLIGHT && state.queue.is_empty() {
            state.in_flight += 1;
            true
        } else {
            false
        }
    }

    /// Queues a step; gives the batch to send now, if a request may go
    /// out (counted in: send it, then call [`finished`](Self::finished)).
    pub(crate) fn queue(&self, step: Queued) -> Option<Vec<Queued>> {
        let mut state = self.state();
        state.queue.push(step);
        take_batch(&mut state)
    }

    /// One request (alone or a batch) was answered: gives the next batch
    /// to send, if any waits (counted in, as from [`queue`](Self::queue)).
    pub(crate) fn finished(&self) -> Option<Vec<Queued>> {
        let mut state = self.state();
        state.in_flight -= 1;
        take_batch(&mut state)
    }
}

fn take_batch(state: &mut State) -> Option<Vec<Queued>> {
    let full = state.queue.len() >= FULL_BATCH && state.in_flight < MAX_IN_FLIGHT_FULL;
    if state.in_flight >= MAX_IN_FLIGHT && !full {
        return None;
    }
    // A caller that gave up while it waited (timed out, or dropped) never
    // sends its step.
    state.queue.retain(|step| !step.answer.is_closed());
    if state.queue.is_empty() {
        return None;
    }
    state.in_flight += 1;
    let n = state.queue.len().min(MAX_BATCH);
    Some(state.queue.drain(..n).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step() -> (
        Queued,
        oneshot::Receiver<Result<redis::Value, BackendError>>,
    ) {
        let (answer, rx) = oneshot::channel();
        let step = Queued {
            keys: vec!["k".to_owned()],
            args: vec!["v".to_owned()],
            answer,
        };
        (step, rx)
    }

    #[test]
    fn steps_go_alone_until_the_wire_is_full_then_wait_for_an_answer() {
        let batcher = Batcher::default();
        for _ in 0..MAX_IN_FLIGHT {
            assert!(batcher.go_alone());
        }
        assert!(!batcher.go_alone(), "the wire is full");
        let mut waiting = Vec::new();
        for _ in 0..3 {
            let (s, rx) = step();
            assert!(batcher.queue(s).is_none(), "no request may go out");
            waiting.push(rx);
        }
        let batch = batcher.finished().expect("an answer lets the queue out");
        assert_eq!(batch.len(), 3);
        assert!(!batcher.go_alone(), "the batch took the freed place");
        assert!(batcher.finished().is_none(), "nothing waits");
        assert!(batcher.go_alone(), "a place is free again");
    }

    #[test]
    fn batches_hold_at_most_max_batch_steps() {
        let batcher = Batcher::default();
        while batcher.go_alone() {}
        let mut receivers = Vec::new();
        // Full batches go out until the wire holds MAX_IN_FLIGHT_FULL.
        for _ in 0..FULL_BATCH * (MAX_IN_FLIGHT_FULL - MAX_IN_FLIGHT) {
            let (s, rx) = step();
            receivers.push(rx);
            let _ = batcher.queue(s);
        }
        for _ in 0..MAX_BATCH + 5 {
            let (s, rx) = step();
            assert!(batcher.queue(s).is_none(), "the wire is full");
            receivers.push(rx);
        }
        assert_eq!(batcher.finished().map(|b| b.len()), Some(MAX_BATCH));
        // The 5 left, fewer than a full batch, wait until fewer than
        // MAX_IN_FLIGHT requests are on the wire.
        let mut answered = 0;
        let rest = loop {
            answered += 1;
            if let Some(batch) = batcher.finished() {
                break batch.len();
            }
        };
        assert_eq!(rest, 5);
        assert_eq!(answered, MAX_IN_FLIGHT_FULL - MAX_IN_FLIGHT + 1);
    }

    #[test]
    fn a_full_queue_goes_out_without_waiting_for_an_answer() {
        let batcher = Batcher::default();
        for _ in 0..MAX_IN_FLIGHT {
            assert!(batcher.go_alone());
        }
        let mut receivers = Vec::new();
        let mut sent = Vec::new();
        for _ in 0..FULL_BATCH * (MAX_IN_FLIGHT_FULL - MAX_IN_FLIGHT + 1) {
            let (s, rx) = step();
            receivers.push(rx);
            if let Some(batch) = batcher.queue(s) {
                sent.push(batch.len());
            }
        }
        assert_eq!(
            sent,
            vec![FULL_BATCH; MAX_IN_FLIGHT_FULL - MAX_IN_FLIGHT],
            "full batches go out until the wire holds MAX_IN_FLIGHT_FULL"
        );
        assert_eq!(batcher.finished().map(|b| b.len()), Some(FULL_BATCH));
    }

    #[test]
    fn steps_whose_callers_gave_up_never_go_out() {
        let batcher = Batcher::default();
        for _ in 0..MAX_IN_FLIGHT {
            assert!(batcher.go_alone());
        }
        let (gone, rx) = step();
        drop(rx);
        assert!(batcher.queue(gone).is_none());
        let (kept, _rx) = step();
        assert!(batcher.queue(kept).is_none());
        let batch = batcher.finished().expect("one step still waits");
        assert_eq!(batch.len(), 1);
        assert!(!batch[0].answer.is_closed());
        assert!(batcher.finished().is_none());
        // Only given-up steps wait: nothing goes out, nothing is counted.
        while batcher.go_alone() {}
        let (gone, rx) = step();
        drop(rx);
        assert!(batcher.queue(gone).is_none());
        assert!(batcher.finished().is_none());
        assert!(batcher.go_alone(), "the given-up step took no place");
    }
}
