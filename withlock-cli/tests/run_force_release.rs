//! `withlock release --force` while a host runs the job: the holder hears
//! the release on the store's release channel and terminates its job at
//! once, not at its next extension \[L5\].

mod common;

use std::time::{Duration, Instant};

use common::{alive, appears, run_expecting, stderr, wait_expecting, Scratch, Store};

/// The holder's ttl puts its first extension 10 s away: a job terminated
/// within half of that after the force release was told by the
/// notification (a wider bound would let the extension pass it; a
/// narrower one fails on a slow machine).
async fn l5_a_force_release_terminates_the_holders_job_before_its_next_extension(store: Store) {
    let key = store.key("forced");
    let scratch = Scratch::new();
    let script = format!(
        "trap 'echo term > {term}; exit 0' TERM; echo $$ > {pid}; \
         while :; do sleep 0.05; done",
        term = scratch.sh("term"),
        pid = scratch.sh("pid"),
    );
    let holder = store
        .cmd("run")
        .args([
            "--ttl", "30s", "--grace", "5s", "--key", &key, "--", "sh", "-c", &script,
        ])
        .spawn()
        .unwrap();
    let pid: i32 = appears(&scratch.path("pid")).await.trim().parse().unwrap();
    run_expecting(store.cmd("release").args(["--force", &key]), 0).await;
    let released_at = Instant::now();
    appears(&scratch.path("term")).await;
    let took = released_at.elapsed();
    assert!(
        took < Duration::from_secs(5),
        "the job got SIGTERM {took:?} after the force release (its next extension was 10 s away)"
    );
    let output = wait_expecting(holder, 79).await;
    assert!(!alive(pid), "the job survived");
    let message = stderr(&output);
    assert!(message.contains("lost the lock"), "{message}");
    assert!(
        !message.contains("expired"),
        "a lock freed while valid was taken, not expired [L1]: {message}"
    );
}

on_every_backend!(l5_a_force_release_terminates_the_holders_job_before_its_next_extension,);
