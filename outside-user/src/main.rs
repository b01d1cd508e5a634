//! The README's Redis setup example, built by a crate that depends on
//! `lock-redis` alone.

use lock_redis::{Locker, RedisBackend};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let locker = Locker::new(RedisBackend::from_url("redis://127.0.0.1:6379")?);
    locker
        .with_lock("nightly:import", |ctx| async move {
            // pass ctx.fencing_token() to the store you protect
            let _token = ctx.fencing_token();
        })
        .await?;
    locker.shutdown(std::time::Duration::from_secs(10)).await;
    Ok(())
}
