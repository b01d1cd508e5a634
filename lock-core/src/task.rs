//! Running a backend step so that dropping its caller cannot strand a lock.

use std::future::Future;
use std::task::Poll;

use tokio::sync::oneshot;

/// Runs `step` to its end even if the returned future is dropped.
///
/// The step is polled once in place, which is all an in-memory step needs.
/// If it is still pending, it moves into a task of its own and this future
/// waits for its answer; if this future is dropped meanwhile, the task goes
/// on and hands the answer to `orphan`. Returns `None` if the step panicked.
pub(crate) async fn finish_even_if_dropped<T, S, O>(step: S, orphan: O) -> Option<T>
where
    T: Send + 'static,
    S: Future<Output = T> + Send + 'static,
    O: FnOnce(T) + Send + 'static,
{
    let mut step = Box::pin(step);
    let first = std::future::poll_fn(|cx| Poll::Ready(step.as_mut().poll(cx))).await;
    if let Poll::Ready(answer) = first {
        return Some(answer);
    }
    let (tx, rx) = oneshot::channel();
    tokio::spawn(async move {
        let answer = step.await;
        if let Err(answer) = tx.send(answer) {
            orphan(answer);
        }
    });
    rx.await.ok()
}

/// A future that never settles: what `with_lock` becomes on a locker that
/// shut down \[S2\].
pub(crate) async fn never<T>() -> T {
    std::future::pending().await
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn a_ready_step_answers_in_place() {
        assert_eq!(finish_even_if_dropped(async { 7 }, |_| {}).await, Some(7));
    }

    #[tokio::test]
    async fn a_dropped_caller_hands_the_answer_to_orphan() {
        let (done_tx, done_rx) = oneshot::channel();
        let (go_tx, go_rx) = oneshot::channel::<()>();
        let caller = finish_even_if_dropped(
            async move {
                let _ = go_rx.await;
                5
            },
            move |v| {
                let _ = done_tx.send(v);
            },
        );
        assert!(tokio::time::timeout(Duration::from_millis(10), caller)
            .await
            .is_err());
        go_tx.send(()).unwrap();
        let orphaned = tokio::time::timeout(Duration::from_secs(5), done_rx).await;
        assert_eq!(orphaned.unwrap().unwrap(), 5);
    }
}
