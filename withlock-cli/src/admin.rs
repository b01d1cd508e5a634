//! `withlock list`, `inspect` and `release`: what the store holds now,
//! through the store's [`LockAdmin`](lock_core::LockAdmin) alone, so every
//! backend and deployment has the same commands \[D1\].

use lock_core::AdminError;

use crate::args::{InspectArgs, ListArgs, MigrateArgs, ReleaseArgs, StatusArgs};
use crate::exit::{Failure, NOT_A_LOCK, USAGE};
use std::time::SystemTime;

use crate::format::{details, kept_text, table, ttl_text, view_json, Shown};
use crate::store::{Scheme, Store};

/// `withlock list`: the locks held now. On a store of several parts (a
/// Redis Cluster's masters) of which some did not answer, the locks of
/// those that did, and on stderr one warning per part that did not
/// (`--json`: one object, `{"unreachable": [{"node", "error"}]}`); the
/// exit code is then that part's error's (69 for one that does not
/// answer), never 0, so that a script does not take the list for whole.
pub(crate) async fn list(args: ListArgs) -> Result<u8, Failure> {
    Scheme::of(&args.store.url)?;
    let store = Store::open(&args.store).await?;
    let listed = store
        .admin()
        .list_locks_partial(&args.prefix)
        .await
        .map_err(|e| Failure::backend(store.name(), &e))?;
    let views = &listed.locks;
    let now = SystemTime::now();
    if args.json {
        let all: Vec<_> = views.iter().map(|v| view_json(v, now)).collect();
        println!("{}", serde_json::Value::Array(all));
    } else if views.is_empty() && listed.is_whole() {
        println!("no locks held");
    } else if views.is_empty() {
        println!("no locks held where the store answered");
    } else {
        print!("{}", table(views, now));
    }
    let mut code = 0;
    let mut unreachable = Vec::new();
    for part in &listed.unreachable {
        let failure = Failure::backend(
            &format!(
                "warning: {}: {} did not answer, its locks are not listed",
                store.name(),
                part.node
            ),
            &part.error,
        );
        if code == 0 {
            code = failure.code;
        }
        if args.json {
            unreachable.push(serde_json::json!({
                "node": part.node,
                "error": lock_core::ErrorChain(&part.error).to_string(),
            }));
        } else {
            eprintln!("withlock: {}", failure.message);
        }
    }
    if !unreachable.is_empty() {
        eprintln!("{}", serde_json::json!({ "unreachable": unreachable }));
    }
    Ok(code)
}

/// `withlock inspect`: one key.
pub(crate) async fn inspect(args: InspectArgs) -> Result<u8, Failure> {
    Scheme::of(&args.store.url)?;
    let store = Store::open(&args.store).await?;
    let view = store
        .admin()
        .inspect(&args.key)
        .await
        .map_err(|e| Failure::backend(store.name(), &e))?;
    if args.json {
        println!("{}", view_json(&view, SystemTime::now()));
    } else {
        print!("{}", details(&view, SystemTime::now()));
    }
    Ok(0)
}

/// `withlock release --force`: frees a key whoever holds it, if it is a
/// withlock lock; anything else is refused (exit 65) and left as it was.
pub(crate) async fn release(args: ReleaseArgs) -> Result<u8, Failure> {
    if !args.force {
        return Err(Failure::new(
            USAGE,
            format!(
                "refusing to free {:?} without --force: a withlock run holding it hears the release within about a second, terminates its command and exits 79",
                args.key
            ),
        ));
    }
    Scheme::of(&args.store.url)?;
    let store = Store::open(&args.store).await?;
    let freed = match store.admin().force_release(&args.key).await {
        Ok(freed) => freed,
        // Not a lock of withlock's format: said, and left untouched [D2].
        Err(refused @ AdminError::NotALock { .. }) => {
            return Err(Failure::new(NOT_A_LOCK, refused.to_string()))
        }
        Err(AdminError::Backend(e)) => return Err(Failure::backend(store.name(), &e)),
        Err(other) => return Err(Failure::backend(store.name(), &other)),
    };
    match freed {
        Some(view) => {
            let node = view.node_id().unwrap_or_default();
            // [H7] A job that ran already, kept to its minimum.
            let ttl = kept_text(&view, SystemTime::now()).map_or_else(
                || {
                    let left = view.ttl.map_or_else(
                        || "no expiry".to_owned(),
                        |t| format!("{} left", ttl_text(t)),
                    );
                    format!(" ({left})")
                },
                |kept| format!(", {kept}"),
            );
            println!(
                "released {}, held by {}{ttl}",
                Shown(&args.key),
                Shown(node)
            );
        }
        None => println!("{} was not held", Shown(&args.key)),
    }
    Ok(0)
}

/// `withlock status`: 0 when the key is held (printing holder, fencing
/// token and time left), 1 when it is free.
pub(crate) async fn status(args: StatusArgs) -> Result<u8, Failure> {
    Scheme::of(&args.store.url)?;
    let store = Store::open(&args.store).await?;
    let view = store
        .admin()
        .inspect(&args.key)
        .await
        .map_err(|e| Failure::backend(store.name(), &e))?;
    let held = view.is_held();
    let now = SystemTime::now();
    if args.json {
        println!("{}", view_json(&view, now));
    } else if held {
        let node = view.node_id().unwrap_or_default();
        let token = view
            .fencing_token
            .map_or_else(|| "none".to_owned(), |t| t.to_string());
        match kept_text(&view, now) {
            // [H7] Its run ended: held to its minimum, nothing runs.
            Some(kept) => println!(
                "{} is held by {} (fencing token {token}), {kept}",
                Shown(&args.key),
                Shown(node)
            ),
            None => {
                let left = view.ttl.map_or_else(
                    || "no expiry".to_owned(),
                    |t| format!("{} left", ttl_text(t)),
                );
                println!(
                    "{} is held by {} (fencing token {token}, {left})",
                    Shown(&args.key),
                    Shown(node)
                );
            }
        }
    } else {
        println!("{} is free", Shown(&args.key));
    }
    Ok(if held { 0 } else { 1 })
}

/// `withlock migrate`: creates the PostgreSQL lock table if it is
/// missing; nothing to do on Redis or etcd.
pub(crate) async fn migrate(args: MigrateArgs) -> Result<u8, Failure> {
    Scheme::of(&args.store.url)?;
    let store = Store::open(&args.store).await?;
    match store.migrate().await? {
        Some(table) => println!("the lock table {table} is ready"),
        None => println!("{} needs no setup: nothing to do", store.name()),
    }
    Ok(0)
}
