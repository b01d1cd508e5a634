//! `withlock list`, `inspect` and `release`: what the store holds now.

use crate::args::{InspectArgs, ListArgs, ReleaseArgs};
use crate::exit::{Failure, USAGE};
use crate::format::{details, table, ttl_text, view_json, Shown};
use crate::store::{Scheme, Store};

/// `withlock list`: the locks held now.
pub(crate) async fn list(args: ListArgs) -> Result<u8, Failure> {
    Scheme::of(&args.store.url)?;
    let store = Store::open(&args.store).await?;
    let views = store
        .list(&args.prefix)
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

/// `withlock release --force`: frees a key whoever holds it.
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
    let freed = store
        .force_release(&args.key)
        .await
        .map_err(|e| Failure::unavailable(store.name(), &e))?;
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
