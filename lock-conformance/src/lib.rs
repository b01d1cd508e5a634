#![doc = include_str!("../README.md")]

pub mod cases;
mod counting;
mod faults;
mod min_ttl;
pub mod runtimes;
mod support;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

pub use counting::CountingBackend;
pub use faults::{is_injected, FaultInjector, InjectedFault, Step};
pub use min_ttl::{with_min_ttl, WithMinTtl};
pub use support::{
    assert_free, assert_freed_soon, assert_held, assert_lost_as, node, once, patient, scaled,
    ttl_scale, within, without_admin, AdminStore, BackendFactory, Namespace, WithoutAdmin, RETRY,
    SHORT_TTL, SOON,
};

/// A case as the list holds it.
pub type CaseFn = fn(Arc<dyn BackendFactory>) -> Pin<Box<dyn Future<Output = ()> + Send>>;

/// One case of the suite.
#[derive(Clone, Copy, Debug)]
pub struct Case {
    /// The case's name, starting with its behaviour id.
    pub name: &'static str,
    /// Runs the case.
    pub run: CaseFn,
}

/// The one list of cases; [`conformance_tests!`] and [`CASES`] both come
/// from it.
#[doc(hidden)]
#[macro_export]
macro_rules! __with_cases {
    ($($mode:tt)*) => {
        $crate::__emit_cases! {
            [$($mode)*]
            o1_callback_output_is_returned,
            o2_panic_releases_then_resumes,
            o3_not_acquired_says_attempts_and_cause,
            o3_attempt_with_lost_answer_leaves_nothing_held,
            o4_lost_is_reported_without_waiting_for_callback,
            o5_bad_input_is_refused_and_touches_nothing,
            o5_keys_are_opaque,
            o6_stalled_holder_is_told_lost,
            o6_key_replaced_before_first_extension_is_lost,
            o6_failed_release_after_a_valid_callback_gives_its_output,
            a1_first_attempt_at_once_then_spaced_retries,
            a2_defaults_give_up_after_eleven_attempts,
            a3_retry_zero_is_single_attempt,
            a4_unlimited_waits_as_long_as_it_takes,
            a5_release_notification_wakes_waiter,
            a6_local_waiters_queue_without_polling,
            a7_retry_delays_are_jittered,
            a9_a_crashed_holders_lock_is_taken_soon_after_it_expires,
            h1_lock_is_extended_while_callback_runs,
            h2_stalled_holder_loses_lock_within_ttl,
            h3_released_when_callback_settles,
            h4_fencing_token_increases_across_nodes,
            h5_stale_owner_changes_nothing,
            h6_callback_never_starts_on_a_late_lease,
            h7_a_short_callback_holds_the_key_until_its_minimum,
            h7_no_extension_in_flight_moves_the_minimum,
            h7_the_hold_step_is_owed_like_a_release,
            h7_shutdown_keeps_minimums_and_releases_cut_callbacks,
            h7_the_admin_tells_a_kept_lock_from_a_running_one,
            l1_key_gone_while_valid_is_lost_as_taken,
            l1_taken_key_is_lost_at_next_extension,
            l2_extension_errors_retry_then_lose,
            l4_batch_errors_touch_only_their_leases,
            l4_hung_leases_hold_up_only_themselves,
            l3_detached_callback_runs_on_and_sees_loss,
            l3_cancel_on_loss_drops_borrowing_callback,
            r1_reentrant_call_runs_without_round_trip,
            r2_other_tasks_and_nodes_wait,
            r3_spawned_task_needs_the_context_carried,
            r4_lockers_never_share_reentrancy,
            c1_drop_while_waiting_leaves_nothing_held,
            c2_drop_while_running_stops_callback_and_releases,
            c3_timeout_behaves_as_drop,
            m1_handle_and_mutex_lock_by_hand,
            m2_mutex_and_with_lock_exclude_each_other,
            s1_shutdown_waits_then_releases,
            s1_shutdown_returns_after_owed_releases,
            s1_shutdown_frees_what_attempts_in_flight_took,
            s2_after_shutdown_calls_never_settle,
            s3_shutdown_returns_by_deadline_when_backend_down,
            f1_nodes_are_served_in_arrival_order,
            f1_a_node_is_not_served_twice_while_another_waits,
            f1_a_try_once_call_leaves_nothing,
            f2_a_cancelled_waiter_leaves_at_once,
            f2_a_stalled_waiter_is_skipped_and_rejoins_at_the_tail,
            f3_an_unclaimed_grant_passes_on_within_the_claim_deadline,
            f5_queued_and_unqueued_callers_exclude_each_other,
            f6_a_backend_without_the_queue_waits_unqueued,
            f6_a_required_queue_fails_rather_than_wait_unqueued,
            step_try_acquire_busy_and_fencing,
            step_extend_never_recreates_a_key,
            step_extend_many_answers_in_order,
            step_release_is_idempotent,
            step_release_notifications_as_declared,
            step_a_wrapper_sees_every_attempt_and_release,
            rel_exclusion_holds_under_faults,
            d1_list_inspect_force_release_agree_with_the_lock,
            d2_force_release_of_a_free_key_changes_nothing,
            l5_force_release_wakes_waiters,
            l5_force_release_is_found_by_its_holder_at_once,
        }
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __emit_cases {
    ([tests $factory:expr] $($case:ident,)*) => {
        $(
            #[test]
            fn $case() {
                $crate::run_case(
                    ::std::stringify!($case),
                    $factory,
                    |f| ::std::boxed::Box::pin($crate::cases::$case(f)),
                );
            }
        )*
    };
    ([list] $($case:ident,)*) => {
        &[$(
            $crate::Case {
                name: ::std::stringify!($case),
                run: |f| ::std::boxed::Box::pin($crate::cases::$case(f)),
            },
        )*]
    };
}

/// Every case of the suite, in the contract's order.
pub const CASES: &[Case] = __with_cases!(list);

/// Expands to one `#[test]` per case, each running on its own two-worker
/// tokio runtime with a fresh backend from `$factory`.
///
/// ```ignore
/// lock_conformance::conformance_tests!(|| async { lock_memory::MemoryBackend::new() });
/// ```
#[macro_export]
macro_rules! conformance_tests {
    ($factory:expr $(,)?) => {
        $crate::__with_cases!(tests $factory);
    };
}

/// How long one case may run before it counts as hung.
pub const CASE_TIMEOUT: Duration = Duration::from_secs(120);

/// Runs one case on a runtime of its own. Used by [`conformance_tests!`].
///
/// # Panics
///
/// When the case fails or runs longer than [`CASE_TIMEOUT`].
pub fn run_case(name: &str, factory: impl BackendFactory, case: CaseFn) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("case {name}: no tokio runtime: {e}"));
    let factory: Arc<dyn BackendFactory> = Arc::new(factory);
    runtime.block_on(async {
        let running = tokio::spawn(case(factory));
        match tokio::time::timeout(CASE_TIMEOUT, running).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Ok(Err(e)) => panic!("case {name} was cancelled: {e}"),
            Err(_) => panic!("case {name} did not finish within {CASE_TIMEOUT:?}"),
        }
    });
    // Background releases spawned by the case get a moment to finish.
    runtime.shutdown_timeout(Duration::from_secs(1));
}

/// Runs every case against `factory`, one after the other, and panics
/// after the last with the list of failures.
///
/// # Panics
///
/// When any case fails.
pub async fn run_all(factory: impl BackendFactory) {
    let factory: Arc<dyn BackendFactory> = Arc::new(factory);
    let mut failed = Vec::new();
    for case in CASES {
        let running = tokio::spawn((case.run)(Arc::clone(&factory)));
        match tokio::time::timeout(CASE_TIMEOUT, running).await {
            Ok(Ok(())) => eprintln!("case {} ... ok", case.name),
            Ok(Err(e)) => {
                eprintln!("case {} ... FAILED: {e}", case.name);
                failed.push(case.name);
            }
            Err(_) => {
                eprintln!("case {} ... FAILED: hung", case.name);
                failed.push(case.name);
            }
        }
    }
    assert!(failed.is_empty(), "conformance cases failed: {failed:?}");
}
