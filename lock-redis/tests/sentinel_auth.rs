//! Sentinel with passwords: data nodes with `requirepass` (and
//! `masterauth`), Sentinels with a password of their own. The backend
//! reaches the primary with the data nodes' credentials, follows a failover
//! with them, and says who refused a wrong password. Each test runs a
//! primary, a replica and three Sentinels of its own.

mod common;

use std::time::Duration;

use common::{node, within};
use lock_core::{BackendErrorKind, LockConfig, LockError};
use lock_redis::{RedisConfig, RedisSentinelBackend, SentinelConfig, SetupError};
use withlock_test_servers::redis::{SentinelAuth, SentinelGroup, MASTER_NAME};

const LIMIT: Duration = Duration::from_secs(40);
const DATA_PW: &str = "data-pw-5f1c";
const SENTINEL_PW: &str = "sentinel-pw-9a3e";

fn group() -> SentinelGroup {
    SentinelGroup::start_with_auth(
        1,
        &SentinelAuth {
            data_node_password: Some(DATA_PW.to_owned()),
            sentinel_password: Some(SENTINEL_PW.to_owned()),
        },
    )
    .unwrap()
}

/// The whole error chain, `Display` of each link.
fn chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut next = error.source();
    while let Some(e) = next {
        text.push_str(": ");
        text.push_str(&e.to_string());
        next = e.source();
    }
    text
}

/// Locks through the data nodes' password; a waiter is woken over the
/// release subscription (which authenticates too); after `SENTINEL
/// FAILOVER` the backend follows to the new primary with the same
/// credentials, and its fencing token is greater than the one before
/// [H4]. `Debug` never shows either password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h4_sentinel_with_passwords_follows_a_failover() {
    let group = group();
    let urls = group.sentinel_urls();
    assert!(
        urls[0].contains(SENTINEL_PW),
        "the URLs carry the Sentinels' password"
    );
    let sentinel = SentinelConfig::new(MASTER_NAME, &urls)
        .unwrap()
        .data_node_password(DATA_PW);
    let shown = format!("{sentinel:?}");
    assert!(
        !shown.contains(DATA_PW) && !shown.contains(SENTINEL_PW),
        "{shown}"
    );
    assert!(
        shown.contains(r#"sentinel_password: "<redacted>""#)
            && shown.contains(r#"data_node_password: "<redacted>""#),
        "{shown}"
    );
    let backend = within(
        LIMIT,
        "connect",
        RedisSentinelBackend::connect_with_config(sentinel.clone(), RedisConfig::default()),
    )
    .await
    .expect("the Sentinels and the primary take their passwords");
    let shown = format!("{backend:?}");
    assert!(
        !shown.contains(DATA_PW) && !shown.contains(SENTINEL_PW),
        "{shown}"
    );
    assert!(!shown.contains("<none>"), "both passwords are set: {shown}");
    let waiter_backend =
        RedisSentinelBackend::with_config(sentinel, RedisConfig::default()).unwrap();
    let a = node(backend, "a");
    let b = node(waiter_backend.clone(), "b");

    // A waiter whose retry timer would not fire within the test gets the
    // lock when the holder releases: the subscription reached the primary.
    let (held, holding) = tokio::sync::oneshot::channel();
    let (release, released) = tokio::sync::oneshot::channel::<()>();
    let holder = tokio::spawn({
        let a = a.clone();
        async move {
            a.with_lock("job", |ctx| async move {
                let _ = held.send(ctx.fencing_token());
                let _ = released.await;
            })
            .await
        }
    });
    let first = within(LIMIT, "first holder", holding).await.unwrap();
    let slow = LockConfig::default()
        .retry_attempts(1)
        .retry_delay(Duration::from_secs(600));
    let waiter = tokio::spawn(async move {
        b.with_lock_config("job", &slow, |ctx| async move { ctx.fencing_token() })
            .await
    });
    within(LIMIT, "the waiter's subscription", async {
        while !waiter_backend.is_subscribed() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    let _ = release.send(());
    within(LIMIT, "release", holder).await.unwrap().unwrap();
    let second = within(LIMIT, "woken waiter", waiter)
        .await
        .unwrap()
        .unwrap();
    assert!(second > first, "token {second} after {first}");

    let old = group.primary().port();
    let mut to_sentinel = redis::Client::open(urls[0].as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let _: () = redis::cmd("SENTINEL")
        .arg("FAILOVER")
        .arg(MASTER_NAME)
        .query_async(&mut to_sentinel)
        .await
        .unwrap();
    let new = tokio::task::block_in_place(|| group.wait_for_failover(old, Duration::from_secs(30)))
        .unwrap();
    assert_ne!(new, old);
    let cfg = LockConfig::default()
        .retry_attempts(100)
        .retry_delay(Duration::from_millis(100));
    let after = within(
        LIMIT,
        "after the failover",
        a.with_lock_config("job", &cfg, |ctx| async move { ctx.fencing_token() }),
    )
    .await
    .unwrap();
    assert!(after > second, "token {after} after {second}");
}

/// A wrong data-node password, none at all, and a wrong Sentinel password
/// are each a setup error from `connect` that names authentication and
/// who refused; a lock call on such a backend gives up with that error as
/// source [A8], and no password shows in any message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a8_refused_sentinel_or_data_node_credentials_are_named() {
    let group = group();
    let urls = group.sentinel_urls();

    let wrong_data = SentinelConfig::new(MASTER_NAME, &urls)
        .unwrap()
        .data_node_password("wrong-data-pw");
    let err = within(
        LIMIT,
        "connect",
        RedisSentinelBackend::connect_with_config(wrong_data.clone(), RedisConfig::default()),
    )
    .await
    .expect_err("a wrong data-node password");
    let text = chain(&err);
    eprintln!("wrong data-node password: {text}");
    assert!(
        matches!(
            err,
            SetupError::AuthenticationRefused {
                refused_by: "the primary named by the Sentinels",
                ..
            }
        ),
        "{err:?}"
    );
    assert!(
        text.contains("authentication refused by the primary"),
        "{text}"
    );
    assert!(!text.contains("wrong-data-pw") && !format!("{err:?}").contains("wrong-data-pw"));

    // Through a lock call: the driver sees a setup error, said at its
    // first attempt [A8], and the acquire error's source names
    // authentication.
    let backend = RedisSentinelBackend::with_config(wrong_data, RedisConfig::default()).unwrap();
    let a = node(backend, "a");
    let once = LockConfig::default()
        .retry_attempts(1)
        .retry_delay(Duration::from_millis(20));
    let result = within(
        LIMIT,
        "giving up",
        a.with_lock_config("job", &once, |_| async { panic!("must not run") }),
    )
    .await;
    match &result {
        Err(LockError::NotAcquired {
            attempts,
            source: Some(source),
            ..
        }) => {
            eprintln!(
                "lock call with a wrong data-node password: {attempts} attempts, kind {:?}",
                source.kind()
            );
            assert_eq!(source.kind(), BackendErrorKind::Setup);
            assert_eq!(*attempts, 1, "a8: refused credentials are not retried");
            let text = chain(source);
            assert!(
                text.contains("the primary named by the Sentinels refused the credentials"),
                "{text}"
            );
        }
        other => panic!("expected NotAcquired with a source, got {other:?}"),
    }
    assert!(!format!("{result:?}").contains("wrong-data-pw"));

    // No data-node password where one is required: NOAUTH, same answer.
    let err = within(
        LIMIT,
        "connect",
        RedisSentinelBackend::connect(MASTER_NAME, &urls),
    )
    .await
    .expect_err("no data-node password");
    assert!(
        matches!(
            err,
            SetupError::AuthenticationRefused {
                refused_by: "the primary named by the Sentinels",
                ..
            }
        ),
        "{err:?}"
    );

    // A wrong Sentinel password: the Sentinels refuse.
    let wrong_urls: Vec<String> = urls
        .iter()
        .map(|u| u.replace(SENTINEL_PW, "wrong-sentinel-pw"))
        .collect();
    let wrong_sentinels = SentinelConfig::new(MASTER_NAME, &wrong_urls)
        .unwrap()
        .data_node_password(DATA_PW);
    let err = within(
        LIMIT,
        "connect",
        RedisSentinelBackend::connect_with_config(wrong_sentinels, RedisConfig::default()),
    )
    .await
    .expect_err("a wrong Sentinel password");
    let text = chain(&err);
    eprintln!("wrong Sentinel password: {text}");
    assert!(
        matches!(
            err,
            SetupError::AuthenticationRefused {
                refused_by: "the Sentinels",
                ..
            }
        ),
        "{err:?}"
    );
    assert!(
        !text.contains("wrong-sentinel-pw") && !format!("{err:?}").contains("wrong-sentinel-pw")
    );
}

/// Sentinel URLs whose passwords differ are refused at setup; without
/// passwords, `Debug` says `<none>` for both.
#[test]
fn sentinel_urls_must_agree_on_credentials() {
    let err = SentinelConfig::new(
        MASTER_NAME,
        [
            "redis://:one@127.0.0.1:26379",
            "redis://:two@127.0.0.1:26380",
        ],
    )
    .unwrap_err();
    assert!(
        matches!(err, SetupError::SentinelCredentialsDiffer),
        "{err:?}"
    );
    let plain = SentinelConfig::new(MASTER_NAME, ["redis://127.0.0.1:26379"]).unwrap();
    let shown = format!("{plain:?}");
    assert!(
        shown.contains(r#"sentinel_password: "<none>""#)
            && shown.contains(r#"data_node_password: "<none>""#),
        "{shown}"
    );
    assert!(matches!(
        SentinelConfig::new(MASTER_NAME, Vec::<String>::new()),
        Err(SetupError::NoSentinels)
    ));
}
