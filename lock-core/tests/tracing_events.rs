//! The driver's tracing events: acquire, wait, extend, release and loss
//! carry the key and the fencing token, and never the owner token's secret.

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lock_conformance::FaultInjector;
use lock_core::{LockConfig, Locker, LockerOptions};
use lock_memory::MemoryBackend;

#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn events_name_the_key_and_token_but_no_secret() {
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let backend = FaultInjector::new(MemoryBackend::new());
    let a = Locker::with_options(
        backend.clone(),
        LockerOptions::default()
            .node_id("node-a")
            .caller_runtime(true),
    )
    .unwrap();
    let b = Locker::with_options(
        backend.clone(),
        LockerOptions::default()
            .node_id("node-b")
            .caller_runtime(true),
    )
    .unwrap();
    let cfg = LockConfig::default().ttl(Duration::from_secs(3));
    let (inside_tx, inside_rx) = tokio::sync::oneshot::channel();
    let holder = {
        let a = a.clone();
        tokio::spawn(async move {
            a.with_lock_config("nightly:import", &cfg, move |_| async move {
                let _ = inside_tx.send(());
                tokio::time::sleep(Duration::from_secs(2)).await;
            })
            .await
        })
    };
    inside_rx.await.unwrap();
    let owner = backend.inner().holder("nightly:import").unwrap();
    // b waits behind a (wait events), then a releases.
    b.with_lock_config(
        "nightly:import",
        &LockConfig::default().wait_forever(),
        |_| async {},
    )
    .await
    .unwrap();
    holder.await.unwrap().unwrap();
    // A loss.
    backend.look_stolen("report", true);
    let lost = a
        .with_lock_config("report", &cfg, |_| async {
            tokio::time::sleep(Duration::from_secs(10)).await;
        })
        .await;
    assert!(lost.is_err());

    let text = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    for needle in [
        "acquire{key=nightly:import}",
        "acquired",
        "busy; waiting",
        "lock extended",
        "released",
        "lock lost",
        "fencing_token=1",
        "cause=another owner took the key, or it was deleted or freed while held",
    ] {
        assert!(
            text.contains(needle),
            "no {needle:?} in the events:\n{text}"
        );
    }
    let secret = owner.as_str().rsplit_once('/').unwrap().1;
    assert!(
        !text.contains(secret),
        "the owner token's random part was logged"
    );
}
