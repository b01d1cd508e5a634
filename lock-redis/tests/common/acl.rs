//! The least-privilege ACL users of the README's table ("Least privilege:
//! the exact ACL"), for keys and channels under [`PREFIX`]: the rules each
//! row lists, made on a server of the test's own.

/// The prefix the users' keys and channels live under.
pub const PREFIX: &str = "jobs:";

/// A lock user on one node (README row "single node").
pub const SINGLE_NODE: &[&str] = &[
    "on",
    "resetkeys",
    "~jobs:*",
    "~{*}:withlock-fence:jobs:*",
    "~{*}:withlock-kept:jobs:*",
    "~{*}:withlock-queue:jobs:*",
    "~{*}:withlock-waiters:jobs:*",
    "resetchannels",
    "&jobs:withlock:released",
    "&jobs:withlock:granted:*",
    "-@all",
    "+ping",
    "+evalsha",
    "+script|load",
    "+get",
    "+set",
    "+del",
    "+pexpire",
    "+time",
    "+incr",
    "+publish",
    "+subscribe",
    "+unsubscribe",
    "+pttl",
    "+exists",
    "+zrange",
    "+zadd",
    "+zrem",
    "+zscore",
    "+hget",
    "+hset",
    "+hdel",
];

/// What a lock user behind Sentinel needs on the data nodes beyond
/// [`SINGLE_NODE`] (README row "Sentinel"): the `redis` crate's Sentinel
/// client asks the primary the Sentinels name for its `ROLE`.
pub const SENTINEL_EXTRA: &[&str] = &["+role"];

/// A lock user on every node of a Redis Cluster (README row "Cluster").
pub const CLUSTER: &[&str] = &[
    "on",
    "resetkeys",
    "~jobs:*",
    "~{*}:withlock-fence:jobs:*",
    "~{*}:withlock-kept:jobs:*",
    "~{*}:withlock-queue:jobs:*",
    "~{*}:withlock-waiters:jobs:*",
    "resetchannels",
    "&{*}:jobs:withlock:released",
    "-@all",
    "+ping",
    "+hello",
    "+evalsha",
    "+script|load",
    "+get",
    "+set",
    "+del",
    "+pexpire",
    "+time",
    "+incr",
    "+spublish",
    "+ssubscribe",
    "+sunsubscribe",
    "+cluster|slots",
    "+cluster|myid",
    "+cluster|nodes",
    "+cluster|info",
    "+asking",
    "+pttl",
    "+exists",
    "+zrange",
    "+zadd",
    "+zrem",
    "+zscore",
    "+hget",
    "+hset",
    "+hdel",
];

/// What an operator (`withlock list`, `inspect`, `release --force`) needs
/// beyond a lock user's rules (README row "operators").
pub const OPERATOR_EXTRA: &[&str] = &["+scan", "+pttl", "+type", "+exists"];

/// Makes (or resets) `user` with `password` and `rules` on the node that
/// `conn` reaches.
pub fn set_user(conn: &mut redis::Connection, user: &str, password: &str, rules: &[&[&str]]) {
    let mut cmd = redis::cmd("ACL");
    cmd.arg("SETUSER")
        .arg(user)
        .arg("reset")
        .arg(format!(">{password}"));
    for rule in rules.iter().flat_map(|r| r.iter()) {
        cmd.arg(*rule);
    }
    let () = cmd.query(conn).expect("the ACL user is made");
}

/// `url` (`redis://host:port`) with `user`'s credentials.
pub fn as_user(url: &str, user: &str, password: &str) -> String {
    url.replace("redis://", &format!("redis://{user}:{password}@"))
}

/// The lock user's name and password, as the tests make it.
pub const LOCKER: (&str, &str) = ("locker", "lock-secret");
/// The operator's name and password, as the tests make it.
pub const OPERATOR: (&str, &str) = ("operator", "op-secret");

/// A conformance factory that locks as [`LOCKER`] and runs the admin
/// cases' reads and forced releases as [`OPERATOR`], each backend made by
/// `connect(user, password)` on the same store.
pub struct AsUsers<F>(pub F);

impl<F, Fut, B> lock_conformance::BackendFactory for AsUsers<F>
where
    F: Fn(&'static str, &'static str) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = B> + Send + 'static,
    B: lock_core::LockBackend + lock_core::LockAdmin,
{
    fn backend(
        &self,
    ) -> std::pin::Pin<
        Box<
            dyn std::future::Future<Output = std::sync::Arc<lock_core::DynLockBackend>> + Send + '_,
        >,
    > {
        let locker = (self.0)(LOCKER.0, LOCKER.1);
        Box::pin(async move {
            std::sync::Arc::new(locker.await) as std::sync::Arc<lock_core::DynLockBackend>
        })
    }

    fn with_admin(
        &self,
    ) -> std::pin::Pin<
        Box<dyn std::future::Future<Output = Option<lock_conformance::AdminStore>> + Send + '_>,
    > {
        let (locker, operator) = (
            (self.0)(LOCKER.0, LOCKER.1),
            (self.0)(OPERATOR.0, OPERATOR.1),
        );
        Box::pin(async move {
            Some(lock_conformance::AdminStore {
                backend: std::sync::Arc::new(locker.await),
                admin: std::sync::Arc::new(operator.await),
            })
        })
    }
}
