//! Batch extension (SPEC P4): a thousand leases in one `extend_many` call,
//! answered in request order, telling Extended, Expired and Taken apart.

use std::time::Duration;

use lock_core::{AcquireOutcome, ExtendOutcome, ExtendRequest, Lease, LockBackend, OwnerToken};
use lock_postgres::testing::TestBackend;
use lock_postgres::MAX_EXTEND_BATCH;
use withlock_test_servers::postgres::database_url;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_batch_is_extended_in_one_call_in_order() {
    let backend = TestBackend::new(&database_url()).await.unwrap();
    assert_eq!(backend.capabilities().max_extend_batch, MAX_EXTEND_BATCH);
    let ns = format!("batch:{:016x}:", rand::random::<u64>());
    let ttl = Duration::from_secs(30);
    let (ours, theirs) = (OwnerToken::new("a"), OwnerToken::new("b"));
    // Rows for the whole batch in one statement, as if acquired by `ours`;
    // every 100th by `theirs`, every 100th + 1 already released.
    sqlx::query(&format!(
        "INSERT INTO {} (key, locked_by, locked_at, locked_until, sequence) \
         SELECT $1 || i, CASE WHEN i % 100 = 0 THEN $3 WHEN i % 100 = 1 THEN NULL ELSE $2 END, \
                clock_timestamp() AT TIME ZONE 'UTC', \
                clock_timestamp() AT TIME ZONE 'UTC' + interval '10 seconds', 1 \
         FROM generate_series(0, $4 - 1) AS i",
        backend.qualified_table()
    ))
    .bind(&ns)
    .bind(ours.as_str())
    .bind(theirs.as_str())
    .bind(i32::try_from(MAX_EXTEND_BATCH).unwrap())
    .execute(backend.pool())
    .await
    .unwrap();
    let requests: Vec<_> = (0..MAX_EXTEND_BATCH)
        .map(|i| ExtendRequest {
            lease: Lease::new(format!("{ns}{i}"), ours.clone(), 1),
            ttl,
        })
        .collect();
    let outcomes = backend
        .extend_many(&requests)
        .await
        .into_iter()
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    assert_eq!(outcomes.len(), MAX_EXTEND_BATCH);
    for (i, outcome) in outcomes.iter().enumerate() {
        let expected = match i % 100 {
            0 => ExtendOutcome::Taken,
            1 => ExtendOutcome::Expired,
            _ => ExtendOutcome::Extended,
        };
        assert_eq!(*outcome, expected, "request {i}");
    }
    // Extended to 30 s: the server says so.
    let longest: bool = sqlx::query_scalar(&format!(
        "SELECT bool_and(locked_until - (clock_timestamp() AT TIME ZONE 'UTC') > interval '20 seconds') \
         FROM {} WHERE locked_by = $1",
        backend.qualified_table()
    ))
    .bind(ours.as_str())
    .fetch_one(backend.pool())
    .await
    .unwrap();
    assert!(longest);
    // A missing key is Expired and is not created.
    let missing = Lease::new(format!("{ns}missing"), ours.clone(), 1);
    assert_eq!(
        backend.extend(&missing, ttl).await.unwrap(),
        ExtendOutcome::Expired
    );
    let created: bool = sqlx::query_scalar(&format!(
        "SELECT EXISTS (SELECT 1 FROM {} WHERE key = $1)",
        backend.qualified_table()
    ))
    .bind(missing.key())
    .fetch_one(backend.pool())
    .await
    .unwrap();
    assert!(!created, "the missing key was not created by the extension");
    assert!(matches!(
        backend
            .try_acquire(missing.key(), &theirs, ttl)
            .await
            .unwrap(),
        AcquireOutcome::Acquired { .. }
    ));
}
