//! A URL query parameter the URL's driver would ignore (a misspelt
//! `?pasword=`) is refused with exit 64 naming it, before anything is
//! touched, on `redis://`, `redis+cluster://` and `postgres://`; every
//! parameter the driver documents keeps working.

mod common;

use common::{code, finish, stderr, withlock, Store};

/// Where nothing listens: a command that got past the check would end
/// with 69, not 64.
const NOBODY: &str = "127.0.0.1:1";

#[tokio::test]
async fn unknown_url_parameters_are_refused_naming_them() {
    for url in [
        format!("redis://:secret@{NOBODY}/?pasword=x"),
        format!("rediss://:secret@{NOBODY}?protocol=resp3&pasword=x"),
        format!("redis+cluster://:secret@{NOBODY},{NOBODY}?pasword=x"),
        format!("postgres://root:secret@{NOBODY}/test?sslmode=require&pasword=x"),
        format!("postgresql://root:secret@{NOBODY}/test?pasword=x"),
    ] {
        for args in [
            vec!["run", "--url", &url, "--key", "k", "--", "true"],
            vec!["list", "--url", &url],
        ] {
            let output = finish(&mut withlock(&args)).await;
            let message = stderr(&output);
            assert_eq!(code(&output), 64, "{args:?}: {message}");
            assert!(message.contains("\"pasword\""), "{args:?}: {message}");
            assert!(!message.contains("secret"), "{args:?}: {message}");
            assert_eq!(message.lines().count(), 1, "{message}");
        }
    }
}

#[tokio::test]
async fn documented_url_parameters_pass_the_check() {
    for url in [
        format!("redis://{NOBODY}/?protocol=resp3"),
        format!("redis+cluster://{NOBODY},{NOBODY}?protocol=resp2"),
        format!("postgres://root@{NOBODY}/test?sslmode=require&application_name=x"),
        format!("postgres://root@{NOBODY}/test?options[statement_timeout]=5s&sslmode=disable"),
    ] {
        let output = finish(&mut withlock(["list", "--url", &url])).await;
        let message = stderr(&output);
        assert_eq!(code(&output), 69, "{url}: {message}");
    }
}

/// The accepted parameters reach a real server and work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn documented_url_parameters_work() {
    let redis = Store::redis().await;
    let postgres = Store::postgres().await;
    for (store, query) in [
        (&redis, "protocol=resp3"),
        (&redis, "protocol=2"),
        (&postgres, "application_name=withlock-test&sslmode=prefer"),
    ] {
        let mut args = store.args();
        let sep = if args[1].contains('?') { '&' } else { '?' };
        args[1] = format!("{}{sep}{query}", args[1]);
        let key = store.key("query");
        let output = finish(
            withlock(["run"])
                .args(&args)
                .args(["--key", &key, "--", "sh", "-c", "exit 3"]),
        )
        .await;
        assert_eq!(code(&output), 3, "{query}: {}", stderr(&output));
        let output = finish(withlock(["status"]).args(&args).arg(&key)).await;
        assert_eq!(code(&output), 1, "{query}: {}", stderr(&output));
    }
}
