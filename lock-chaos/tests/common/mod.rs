//! Runs the real `chaos` binary for one backend and checks its report.

use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use lock_chaos::analysis::Report;
use lock_chaos::event::FaultKind;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// `var` as a number of seconds, else `default`.
pub(crate) fn seconds_from(var: &str, default: u64) -> u64 {
    std::env::var(var)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// Stops the coordinator if the test ends early: SIGTERM (it then stops
/// its workers and servers), SIGKILL if it is still there after a while.
struct Coordinator(Child);

impl Drop for Coordinator {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            if let Ok(pid) = i32::try_from(self.0.id()) {
                let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
            }
            let deadline = Instant::now() + Duration::from_secs(60);
            while matches!(self.0.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// A finished `chaos run`: how it exited, its report and its directory.
pub(crate) struct Finished {
    pub(crate) status: ExitStatus,
    pub(crate) report: Report,
    pub(crate) dir: PathBuf,
}

/// Runs `chaos run --backend <backend>` for `seconds`, with the `extra`
/// flags, prints its summary and reads its report.
pub(crate) fn run(backend: &str, seconds: u64, extra: &[&str]) -> Finished {
    let dir = std::env::temp_dir().join(format!(
        "withlock-chaos-test-{backend}-{:08x}",
        rand::random::<u32>()
    ));
    let child = Command::new(env!("CARGO_BIN_EXE_chaos"))
        .args([
            "run",
            "--backend",
            backend,
            "--seconds",
            &seconds.to_string(),
        ])
        .args(extra)
        .arg("--out")
        .arg(&dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("the chaos binary starts");
    let mut coordinator = Coordinator(child);
    // The run, its setup and its teardown, with room to spare.
    let deadline = Instant::now() + Duration::from_secs(seconds + 180);
    let status = loop {
        if let Some(status) = coordinator.0.try_wait().expect("wait for chaos") {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "chaos run did not finish in time"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    let mut summary = String::new();
    if let Some(mut out) = coordinator.0.stdout.take() {
        use std::io::Read;
        out.read_to_string(&mut summary).expect("read chaos output");
    }
    println!("{summary}");
    assert!(
        status.code() == Some(0) || status.code() == Some(1),
        "chaos run could not be made ({status}); see its stderr above"
    );
    let json = std::fs::read_to_string(dir.join("report.json")).expect("report.json written");
    let report: Report = serde_json::from_str(&json).expect("report.json parses");
    Finished {
        status,
        report,
        dir,
    }
}

/// On one hot key, at least this many pairs of waiters seen in the
/// store's queue must have had their order checked \[F1\]: a 40 s run
/// checks about 80 to 120 on each backend.
pub(crate) const MIN_ORDER_PAIRS_CHECKED: usize = 25;

/// Runs `chaos run --backend <backend>` for `seconds`, with the `extra`
/// flags, with every fault of the backend (or those `--faults` names) and
/// asserts that the analysis is clean, that each of them happened and that
/// the leak check looked at the run's `keys` keys. On one key (every worker's waiter in the fair
/// queue), the queue's order must have been checked on
/// [`MIN_ORDER_PAIRS_CHECKED`] pairs at least, a fifth or more of the
/// pairs seen (not counting those acquired before a read saw them), at
/// most half of them excused.
pub(crate) fn run_and_check(backend: &str, seconds: u64, keys: usize, extra: &[&str]) {
    let Finished {
        status,
        report,
        dir,
    } = run(backend, seconds, extra);
    // The faults asked for with `--faults`, else every fault of the backend.
    let asked: Option<Vec<&str>> = extra
        .iter()
        .position(|flag| *flag == "--faults")
        .and_then(|i| extra.get(i + 1))
        .map(|list| list.split(',').collect());
    let kinds = FaultKind::for_backend(backend).iter().filter(|kind| {
        asked
            .as_ref()
            .is_none_or(|names| names.contains(&kind.name()))
    });
    for kind in kinds {
        assert!(
            report.summary.fault_counts.get(kind).copied().unwrap_or(0) >= 1,
            "fault {} did not happen in {seconds} s (raise CHAOS_SECONDS)",
            kind.name()
        );
    }
    assert!(report.summary.sections > 0, "no callback ran");
    assert!(
        report.summary.writes_accepted > 0,
        "no fenced write was accepted"
    );
    assert_eq!(
        report.summary.leak_keys_checked,
        Some(keys),
        "the final leak check ran"
    );
    assert_eq!(
        report.summary.worker_leak_checks, 3,
        "each worker checked its own keys when its shutdown returned"
    );
    assert!(
        report.is_clean(),
        "the analysis found violations:\n{report}"
    );
    if keys == 1 {
        let order = report
            .summary
            .queue_order
            .as_ref()
            .expect("the fair queue was read with two waiters or more");
        let checked = order.checked();
        let decidable = order.pairs - order.acquired_before_read;
        assert!(
            checked >= MIN_ORDER_PAIRS_CHECKED && checked * 5 >= decidable,
            "the order of only {checked} of {decidable} pairs of waiters was checked:\n{report}"
        );
        assert!(
            order.excused * 2 <= checked,
            "most checked pairs needed an excuse:\n{report}"
        );
    }
    assert_eq!(status.code(), Some(0), "a clean report exits 0");
    let _ = std::fs::remove_dir_all(&dir);
}
