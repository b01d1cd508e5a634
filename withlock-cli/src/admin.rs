//! `withlock list`, `inspect` and `release`: what the store holds now,
//! through the store's [`LockAdmin`](lock_core::LockAdmin) alone, so every
//! backend and deployment has the same commands \[D1\].

use lock_core::AdminError;

use crate::args::{InspectArgs, ListArgs, ReleaseArgs};
use crate::exit::{Failure, NOT_A_LOCK, USAGE};
use crate::format::{details, table, ttl_text, view_json, Shown};
use crate::store::{Scheme, Store};

/// `withlock list`: the locks held now.
pub(crate) async fn list(args: ListArgs) -> Result<u8, Failure> {
    Scheme::of(&args.store.url)?;
    let store = Store::open(&args.store).await?;
    let views = store
        .admin()
        .list_locks(&args.prefix)
        .await
        .map_err(|e| Failure::unavailable(store.name(), &e))?;
    if args.json {
        let all: Vec<_> = views.iter().map(view_json).collect();
        println!("{}", serde_json::Value::Array(all));
    } else if views.is_empty() {
        println!("no locks held");
    } else {
        print!("{}", table(&views));
    }
    Ok(0)
}

/// `withlock inspect`: one key.
pub(crate) async fn inspect(args: InspectArgs) -> Result<u8, Failure> {
    Scheme::of(&args.store.url)?;
    let store = Store::open(&args.store).await?;
    let view = store
        .admin()
        .inspect(&args.key)
        .await
        .map_err(|e| Failure::unavailable(store.name(), &e))?;
    if args.json {
        println!("{}", view_json(&view));
    } else {
        print!("{}", details(&view));
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
                "refusing to free {:?} without --force: its holder would go on without the lock until its next extension",
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
        Err(AdminError::Backend(e)) => return Err(Failure::unavailable(store.name(), &e)),
        Err(other) => return Err(Failure::unavailable(store.name(), &other)),
    };
    match freed {
        Some(view) => {
            let node = view.node_id().unwrap_or_default();
            let ttl = view.ttl.map_or_else(
                || "no expiry".to_owned(),
                |t| format!("{} left", ttl_text(t)),
            );
            println!(
                "released {}, held by {} ({ttl})",
                Shown(&args.key),
                Shown(node)
            );
        }
        None => println!("{} was not held", Shown(&args.key)),
    }
    Ok(0)
}
