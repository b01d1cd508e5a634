//! Runnable programs showing withlock; the library itself is empty.
//!
//! Each program is in `examples/` and says at its top what it shows:
//!
//! | program | shows |
//! |---|---|
//! | `quickstart` | exclusion, giving up, fencing tokens, reentrancy, a lost lock and shutdown, on three nodes |
//! | `run_once` | a task run on one node at a time |
//! | `refuse_if_busy` | a task refused when already running, told apart from the task's own error |
//! | `wait_forever` | a task that outlives the ttl, and a node that waits as long as it takes |
//! | `bench_memory` | SPEC P6: an uncontended cycle against a `tokio::sync::Mutex` |
//! | `bench_extension` | SPEC P4: 10,000 locks held at once by one node |
//!
//! ```text
//! cargo run -p withlock-examples --example quickstart
//! cargo run --release -p withlock-examples --example bench_memory
//! ```

/// The workspace README, whose Rust blocks `cargo test` compiles (and runs,
/// where they need no server).
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct ReadmeDoctests;
