//! The operator's functions on PostgreSQL beyond the conformance cases: a
//! forced release frees only a lock of the kind withlock takes \[D2\] (a
//! withlock or Ruby Locker holder, with an expiry), leaving any other row
//! as it was, and the admin shows how long a key has been held and the
//! last holder of an expired row \[D1\].

use std::time::Duration;

use lock_core::{AdminError, LockAdmin, OwnerToken};
use lock_postgres::testing::TestBackend;
use withlock_test_servers::postgres::database_url;

const HEX: &str = "0123456789abcdef0123456789abcdef";

/// A row written by hand: `locked_by`, and `locked_until` that many
/// seconds from now (`None`: NULL).
async fn write_row(backend: &TestBackend, key: &str, locked_by: &str, until_s: Option<i32>) {
    sqlx::query(&format!(
        "INSERT INTO {} (key, locked_by, locked_at, locked_until, sequence) \
         VALUES ($1, $2, clock_timestamp() AT TIME ZONE 'UTC', \
                 clock_timestamp() AT TIME ZONE 'UTC' + $3 * interval '1 second', 41)",
        backend.qualified_table()
    ))
    .bind(key)
    .bind(locked_by)
    .bind(until_s)
    .execute(backend.pool())
    .await
    .unwrap();
}

/// The whole row as text, to compare before and after.
async fn row_text(backend: &TestBackend, key: &str) -> Option<String> {
    sqlx::query_scalar(&format!(
        "SELECT l::text FROM {} AS l WHERE key = $1",
        backend.qualified_table()
    ))
    .bind(key)
    .fetch_optional(backend.pool())
    .await
    .unwrap()
}

async fn new_backend() -> TestBackend {
    TestBackend::new(&database_url()).await.unwrap()
}

/// \[D2\] A held row whose holder is in neither withlock's format nor Ruby
/// Locker's, and a held row without `locked_until`, are refused with what
/// they are, and left exactly as they were.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d2_force_release_refuses_a_row_of_another_format() {
    let backend = new_backend().await;
    for (key, locked_by, until, found) in [
        (
            "other-format",
            "maintenance by ops",
            Some(60),
            "a holder in neither withlock's owner-token format nor Ruby Locker's",
        ),
        (
            "short-guid",
            "pid:42 guid:0123",
            Some(60),
            "a holder in neither withlock's owner-token format nor Ruby Locker's",
        ),
        (
            "no-expiry",
            &format!("node/{HEX}") as &str,
            None,
            "a held row without locked_until (no expiry)",
        ),
    ] {
        write_row(&backend, key, locked_by, until).await;
        let before = row_text(&backend, key).await;
        let refused = backend.force_release(key).await;
        match &refused {
            Err(AdminError::NotALock { key: k, found: f }) => {
                assert_eq!((k.as_str(), f.as_str()), (key, found));
            }
            other => panic!("{key}: {other:?}"),
        }
        assert_eq!(row_text(&backend, key).await, before, "{key} untouched");
        assert!(backend.inspect(key).await.unwrap().is_held(), "{key}");
    }
}

/// \[D2\] A Ruby Locker row (`host:… pid:… guid:<32 hex>`) is a lock of
/// the kind withlock takes: freed as a release frees it (the row and its
/// sequence stay), and given back with its holder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d2_a_ruby_locker_lock_is_freed() {
    let backend = new_backend().await;
    for (key, holder) in [
        ("ruby", format!("host:web-1.example pid:4242 guid:{HEX}")),
        ("ruby-no-host", format!("pid:4242 guid:{HEX}")),
    ] {
        write_row(&backend, key, &holder, Some(30)).await;
        let freed = backend.force_release(key).await.unwrap().expect("freed");
        assert_eq!(freed.owner.unwrap().as_str(), holder);
        assert_eq!(freed.fencing_token, Some(41));
        let after = backend.inspect(key).await.unwrap();
        assert!(!after.is_held() && after.last_owner.is_none(), "{after:?}");
        assert_eq!(after.fencing_token, Some(41), "the row keeps its sequence");
    }
}

/// \[D2\] The statement's holder test is `OwnerToken::is_well_formed` for
/// values that are not Ruby Locker's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d2_the_statements_owner_token_test_is_lock_cores() {
    let backend = new_backend().await;
    let values = [
        format!("node/{HEX}"),
        format!("n/{}", HEX.to_uppercase()),
        format!("a/b/{HEX}"),
        format!("\n/{HEX}"),
        format!("/{HEX}"),
        format!("node/{}", &HEX[1..]),
        format!("node/{HEX}0"),
        format!("node/{}g", &HEX[1..]),
        format!("node/{HEX}\n"),
        format!("node{HEX}"),
        "plain".to_owned(),
    ];
    for (i, value) in values.iter().enumerate() {
        let key = format!("format-{i}");
        write_row(&backend, &key, value, Some(60)).await;
        let well_formed = OwnerToken::is_well_formed(value);
        match backend.force_release(&key).await {
            Ok(Some(_)) => assert!(well_formed, "{value:?} freed"),
            Err(AdminError::NotALock { .. }) => assert!(!well_formed, "{value:?} refused"),
            other => panic!("{value:?}: {other:?}"),
        }
    }
}

/// \[D1, D2\] A held key shows how long it has been held (from
/// `locked_at`); a row whose holder's time ran out is free, shows its last
/// holder, and a forced release leaves it as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d1_held_for_and_last_owner_come_from_the_row() {
    let backend = new_backend().await;
    let holder = format!("node-a/{HEX}");
    write_row(&backend, "held", &holder, Some(60)).await;
    sqlx::query(&format!(
        "UPDATE {} SET locked_at = locked_at - interval '90 seconds' WHERE key = 'held'",
        backend.qualified_table()
    ))
    .execute(backend.pool())
    .await
    .unwrap();
    let info = backend.inspect("held").await.unwrap();
    let held_for = info.held_for.expect("held_for of a held row");
    assert!(
        held_for >= Duration::from_secs(90) && held_for < Duration::from_secs(120),
        "{held_for:?}"
    );
    assert!(backend.list_locks("").await.unwrap()[0].held_for.is_some());

    write_row(&backend, "expired", &holder, Some(-1)).await;
    let info = backend.inspect("expired").await.unwrap();
    assert!(!info.is_held() && info.held_for.is_none(), "{info:?}");
    assert_eq!(
        info.last_owner.as_ref().map(OwnerToken::as_str),
        Some(holder.as_str())
    );
    let before = row_text(&backend, "expired").await;
    assert!(backend.force_release("expired").await.unwrap().is_none());
    assert_eq!(row_text(&backend, "expired").await, before);
    let keys: Vec<String> = backend
        .list_locks("")
        .await
        .unwrap()
        .into_iter()
        .map(|i| i.key)
        .collect();
    assert_eq!(keys, ["held"]);
}

/// `key`'s row: holder, and `locked_until` as microseconds after
/// `locked_at` and after the Unix epoch; `None` when there is no row.
async fn row_times(backend: &TestBackend, key: &str) -> Option<(Option<String>, i64, i64)> {
    sqlx::query_as(&format!(
        "SELECT locked_by, \
                (extract(epoch FROM (locked_until - locked_at)) * 1000000)::bigint, \
                (extract(epoch FROM locked_until) * 1000000)::bigint \
         FROM {} WHERE key = $1",
        backend.qualified_table()
    ))
    .bind(key)
    .fetch_optional(backend.pool())
    .await
    .unwrap()
}

/// A run that ends at once on `key`, kept by a minimum hold of `hold`.
async fn short_run(backend: &TestBackend, key: &str, hold: Duration) {
    let locker = lock_core::Locker::new(backend.backend().clone());
    let cfg = lock_core::LockConfig::default()
        .retry_attempts(0)
        .hold_at_least(hold);
    locker
        .with_lock_config(key, &cfg, |_| async {})
        .await
        .expect("the run and its hold step");
}

/// \[H7, D1\] The hold step leaves the lock's row as Ruby Locker reads it
/// (the holder's token, `locked_until` at `locked_at` plus the minimum)
/// and takes the row `withlock-kept:<key>` for the same holder until the
/// same time: the admin shows the lock kept and does not list the record
/// as a lock; a forced release frees both. A row of that name held by
/// another client is its own lock: the hold leaves it alone, and the
/// admin shows the lock as running and lists that row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h7_the_hold_is_recorded_in_a_row_beside_the_lock() {
    let backend = new_backend().await;
    let hold = Duration::from_secs(30);
    short_run(&backend, "nightly", hold).await;
    let (owner, span_us, until_us) = row_times(&backend, "nightly").await.unwrap();
    let owner = owner.expect("held to its minimum");
    assert!(OwnerToken::is_well_formed(&owner), "{owner:?}");
    assert_eq!(span_us, 30_000_000, "locked_until is locked_at + the hold");
    let record = format!("{}nightly", lock_postgres::KEPT_PREFIX);
    assert_eq!(record, "withlock-kept:nightly");
    let (record_owner, _, record_until_us) = row_times(&backend, &record).await.unwrap();
    assert_eq!(record_owner.as_deref(), Some(owner.as_str()));
    assert_eq!(
        record_until_us, until_us,
        "the record expires with the lock"
    );

    let info = backend.inspect("nightly").await.unwrap();
    assert!(info.is_kept(), "{info:?}");
    let left = info.minimum_hold_left.unwrap();
    assert!(left <= hold && left > hold / 2, "{info:?}");
    assert_eq!(info.minimum_hold_left, info.ttl);
    let listed = backend.list_locks("").await.unwrap();
    assert_eq!(listed.len(), 1, "the record is not listed: {listed:?}");
    assert!(listed[0].key == "nightly" && listed[0].is_kept());

    let freed = backend.force_release("nightly").await.unwrap().unwrap();
    assert!(freed.is_kept(), "{freed:?}");
    let (record_owner, _, _) = row_times(&backend, &record).await.unwrap();
    assert_eq!(record_owner, None, "the record is freed with its lock");
    assert!(backend.list_locks("").await.unwrap().is_empty());

    // Another client's lock of the record's name stays its own.
    let ruby = format!("host:web-1 pid:42 guid:{HEX}");
    write_row(&backend, "withlock-kept:other", &ruby, Some(60)).await;
    let before = row_text(&backend, "withlock-kept:other").await;
    short_run(&backend, "other", hold).await;
    assert_eq!(row_text(&backend, "withlock-kept:other").await, before);
    let info = backend.inspect("other").await.unwrap();
    assert!(info.is_held() && !info.is_kept(), "{info:?}");
    let keys: Vec<String> = backend
        .list_locks("")
        .await
        .unwrap()
        .into_iter()
        .map(|i| i.key)
        .collect();
    assert_eq!(keys, ["other", "withlock-kept:other"]);
}

/// \[H7\] A table whose `key` column cannot take the record's longer key
/// (a `varchar` as an older Rails migration makes it) refuses the record:
/// the hold step goes again without it, so the key is still held to its
/// minimum, and the admin shows the lock as running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h7_a_table_that_refuses_the_record_still_holds_to_the_minimum() {
    let backend = new_backend().await;
    sqlx::query(&format!(
        "ALTER TABLE {} ALTER COLUMN key TYPE varchar(20)",
        backend.qualified_table()
    ))
    .execute(backend.pool())
    .await
    .unwrap();
    let key = "twenty-chars-exactly";
    let hold = Duration::from_secs(30);
    short_run(&backend, key, hold).await;
    let (owner, span_us, _) = row_times(&backend, key).await.unwrap();
    assert!(owner.is_some(), "held to its minimum");
    assert_eq!(span_us, 30_000_000);
    let info = backend.inspect(key).await.unwrap();
    assert!(info.is_held() && !info.is_kept(), "{info:?}");
}
