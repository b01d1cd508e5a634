//! Redis's own words reach the error a call returns, printed with
//! `lock_core::ErrorChain` as every log line of the driver prints it, once
//! \[O3\] \[O4\].

mod common;

use std::time::Duration;

use common::{acl, raw, redis_error_in, within};
use lock_core::{ErrorChain, LockConfig, LockError, Locker, LossCause};
use lock_redis::testing::Namespace;
use lock_redis::RedisBackend;
use redis::AsyncCommands;
use withlock_test_servers::redis::{server_url, RedisServer};

const LIMIT: Duration = Duration::from_secs(10);

/// What Redis said, as the chain must show it: the server's reply where
/// the backend kept it in its own words (`lock_redis::ServerReply`), else
/// the text of the Redis error in `error`'s chain.
fn redis_words(error: &LockError) -> String {
    let mut next: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(e) = next {
        if let Some(backend) = e.downcast_ref::<lock_core::BackendError>() {
            if let Some(reply) = backend.inner().downcast_ref::<lock_redis::ServerReply>() {
                return reply.to_string();
            }
        }
        next = e.source();
    }
    redis_error_in(error)
        .unwrap_or_else(|| panic!("no Redis error in {error:?}"))
        .to_string()
}

/// An acquisition refused by Redis (a fencing companion that holds no
/// counter): the error's chain ends with the words Redis answered, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn o3_a_refusal_by_redis_names_its_words_in_the_chain() {
    let url = server_url().await;
    let ns = Namespace::new(&url);
    let backend = RedisBackend::from_url(&url).unwrap();
    let key = ns.key("refused");
    let mut conn = raw(&url).await;
    let _: () = conn
        .hset(backend.fence_key(&key), "field", "value")
        .await
        .unwrap();
    let locker = Locker::new(backend);
    let error = within(
        LIMIT,
        "with_lock",
        locker.with_lock(&key, |_| async { panic!("the callback must not run") }),
    )
    .await
    .unwrap_err();
    let words = redis_words(&error);
    assert!(words.contains("fencing companion"), "{words}");
    let chain = ErrorChain(&error).to_string();
    eprintln!("{chain}");
    assert_eq!(chain.matches(&words).count(), 1, "{chain}");
    assert!(chain.ends_with(&words), "{chain}");
    // The backend error alone says it too.
    let LockError::NotAcquired {
        source: Some(backend_error),
        ..
    } = &error
    else {
        panic!("{error:?}")
    };
    assert!(
        backend_error.to_string().ends_with(&words),
        "{backend_error}"
    );
}

/// A lock lost to Redis errors (its user's right to run the scripts
/// taken away while it is held, on a server of the test's own, so that
/// every extension is refused): the lost error's chain ends with Redis's
/// `NOPERM` words, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn o4_a_loss_to_redis_errors_names_its_words_in_the_chain() {
    let server = RedisServer::start().unwrap();
    let url = server.url();
    let mut admin = server.client().unwrap().get_connection().unwrap();
    let (user, password) = acl::LOCKER;
    acl::set_user(&mut admin, user, password, &[acl::SINGLE_NODE]);
    let backend = RedisBackend::from_url(&acl::as_user(&url, user, password)).unwrap();
    let locker = Locker::new(backend);
    let cfg = LockConfig::default().ttl(Duration::from_millis(600));
    let key = format!("{}lost", acl::PREFIX);
    let result = within(
        LIMIT,
        "with_lock",
        locker.with_lock_config(&key, &cfg, |_| async move {
            let () = redis::cmd("ACL")
                .arg("SETUSER")
                .arg(user)
                .arg("-evalsha")
                .query(&mut admin)
                .unwrap();
            std::future::pending::<()>().await;
        }),
    )
    .await;
    let error = result.unwrap_err();
    let Some(LossCause::Backend(_)) = error.loss_cause() else {
        panic!("not a loss to backend errors: {error:?}");
    };
    let words = redis_words(&error);
    assert!(words.contains("NOPERM"), "{words}");
    let chain = ErrorChain(&error).to_string();
    eprintln!("{chain}");
    assert_eq!(chain.matches(&words).count(), 1, "{chain}");
    assert!(chain.ends_with(&words), "{chain}");
    assert!(!chain.contains(password), "{chain}");
}
