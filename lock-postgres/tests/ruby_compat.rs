//! Ruby's Locker gem on the same table: its own statements, as issue 4
//! quotes them (UTC timestamps from `clock_timestamp()`, 30 s locks), from a
//! plain connection. Both sides exclude each other, neither releases the
//! other's lock, and `sequence` increases on both paths (Locker adds one,
//! withlock takes at least the database clock in microseconds).

mod common;

use std::time::Duration;

use common::Ruby;
use lock_core::{AcquireOutcome, Lease, LockBackend, LockConfig, OwnerToken, ReleaseOutcome};
use lock_postgres::testing::TestBackend;
use withlock_test_servers::postgres::database_url;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ruby_locker_and_withlock_exclude_each_other() {
    let backend = TestBackend::new(&database_url()).await.unwrap();
    let ruby = Ruby::new(backend.qualified_table()).await;
    let key = format!("ruby:{:016x}", rand::random::<u64>());
    let ruby_id = "ruby-host-42-0x7f";
    let ttl = Duration::from_secs(30);

    // withlock creates the row; Locker's get is an UPDATE of an existing row.
    let ours = OwnerToken::new("rust");
    let AcquireOutcome::Acquired { fencing_token: t1 } =
        backend.try_acquire(&key, &ours, ttl).await.unwrap()
    else {
        panic!("a new key is free");
    };
    assert_eq!(ruby.sequence(&key).await, i64::try_from(t1).unwrap());
    let lease = Lease::new(key.as_str(), ours.clone(), t1);

    // Held by withlock: Locker cannot get, renew or release it.
    assert!(
        !ruby.run(&ruby.get, &key, ruby_id).await,
        "ruby get excluded"
    );
    assert!(!ruby.run(&ruby.renew, &key, ruby_id).await);
    assert!(!ruby.run(&ruby.release, &key, ruby_id).await);
    assert_eq!(
        backend.extend(&lease, ttl).await.unwrap(),
        lock_core::ExtendOutcome::Extended
    );
    assert_eq!(
        backend.release(&lease).await.unwrap(),
        ReleaseOutcome::Released
    );

    // Free again: Locker gets it, and its get bumps the sequence.
    assert!(
        ruby.run(&ruby.get, &key, ruby_id).await,
        "ruby gets the freed key"
    );
    let t2 = ruby.sequence(&key).await;
    assert_eq!(t2, i64::try_from(t1).unwrap() + 1);
    assert!(ruby.run(&ruby.renew, &key, ruby_id).await);

    // Held by Locker: withlock is busy, and cannot release or extend it.
    let other = OwnerToken::new("rust");
    assert!(matches!(
        backend.try_acquire(&key, &other, ttl).await.unwrap(),
        AcquireOutcome::Busy { .. }
    ));
    let forged = Lease::new(key.as_str(), other.clone(), 0);
    assert_eq!(
        backend.release(&forged).await.unwrap(),
        ReleaseOutcome::NotHeld
    );
    assert_eq!(
        backend.extend(&forged, ttl).await.unwrap(),
        lock_core::ExtendOutcome::Taken
    );
    let locker = lock_core::Locker::new(backend.backend().clone());
    let refused = locker
        .with_lock_config(&key, &LockConfig::default().retry_attempts(0), |_| async {})
        .await;
    assert!(refused.is_err_and(|e| e.is_not_acquired()));
    assert!(ruby.run(&ruby.renew, &key, ruby_id).await, "still Locker's");

    // Locker releases; withlock takes it with a greater fencing token.
    assert!(ruby.run(&ruby.release, &key, ruby_id).await);
    let token = locker
        .with_lock_config(
            &key,
            &LockConfig::default().retry_attempts(0),
            |ctx| async move { ctx.fencing_token() },
        )
        .await
        .unwrap();
    let t3 = i64::try_from(token).unwrap();
    assert!(t3 > t2, "token {t3} after Locker's {t2}");
    assert_eq!(ruby.sequence(&key).await, t3, "the row keeps its sequence");

    // And Locker gets it again after withlock released it.
    assert!(ruby.run(&ruby.get, &key, ruby_id).await);
    assert_eq!(ruby.sequence(&key).await, t3 + 1);
    assert!(ruby.run(&ruby.release, &key, ruby_id).await);
}

/// An expired Locker lock is taken over by withlock (and the other way
/// round), as both read `locked_until` in UTC from the database clock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_locks_are_taken_over_on_both_sides() {
    let backend = TestBackend::new(&database_url()).await.unwrap();
    let ruby = Ruby::new(backend.qualified_table()).await;
    let key = format!("ruby-expired:{:016x}", rand::random::<u64>());
    let ours = OwnerToken::new("rust");
    let short = Duration::from_millis(200);
    assert!(matches!(
        backend.try_acquire(&key, &ours, short).await.unwrap(),
        AcquireOutcome::Acquired { .. }
    ));
    tokio::time::sleep(short + Duration::from_millis(100)).await;
    assert!(
        ruby.run(&ruby.get, &key, "ruby").await,
        "ruby takes over the expired lock"
    );
    // Make Locker's lock expire by hand, then withlock takes over.
    sqlx::query(&format!(
        "UPDATE {} SET locked_until = clock_timestamp() at time zone 'UTC' - interval '1 second' WHERE key = $1",
        backend.qualified_table()
    ))
    .bind(&key)
    .execute(&ruby.pool)
    .await
    .unwrap();
    let before = ruby.sequence(&key).await;
    let AcquireOutcome::Acquired { fencing_token } = backend
        .try_acquire(&key, &ours, Duration::from_secs(30))
        .await
        .unwrap()
    else {
        panic!("an expired Locker lock is free");
    };
    assert!(i64::try_from(fencing_token).unwrap() > before);
    assert!(
        !ruby.run(&ruby.release, &key, "ruby").await,
        "ruby's stale release changes nothing"
    );
    assert_eq!(
        backend
            .release(&Lease::new(key.as_str(), ours, fencing_token))
            .await
            .unwrap(),
        ReleaseOutcome::Released
    );
}
