//! `withlock status KEY`: exit 0 and the holder, fencing token and time
//! left when the key is held, exit 1 when it is free.

mod common;

use common::{code, finish, stderr, stdout, Store};

async fn status_is_0_when_held_and_1_when_free(store: Store) {
    let key = store.key("status me");
    let output = finish(store.cmd("status").arg(&key)).await;
    assert_eq!(code(&output), 1, "{}", stderr(&output));
    assert!(stdout(&output).contains("is free"), "{}", stdout(&output));

    let (_locker, mut held) = store.hold(&key, "host-one").await;
    let token = store.stored(&key).await.fencing_token.unwrap();
    let output = finish(store.cmd("status").arg(&key)).await;
    assert_eq!(code(&output), 0, "{}", stderr(&output));
    let text = stdout(&output);
    assert!(text.contains("host-one"), "{text}");
    assert!(text.contains(&token.to_string()), "{text}");
    assert!(text.contains("left"), "{text}");

    let output = finish(store.cmd("status").args(["--json", &key])).await;
    assert_eq!(code(&output), 0, "{}", stderr(&output));
    let value: serde_json::Value = serde_json::from_str(&stdout(&output)).unwrap();
    assert_eq!(value["held"], true);
    assert_eq!(value["node_id"], "host-one");
    assert_eq!(value["fencing_token"], token);

    held.release().await.unwrap();
    let output = finish(store.cmd("status").args(["--json", &key])).await;
    assert_eq!(code(&output), 1, "{}", stderr(&output));
    let value: serde_json::Value = serde_json::from_str(&stdout(&output)).unwrap();
    assert_eq!(value["held"], false);
}

on_every_backend!(status_is_0_when_held_and_1_when_free);
