//! The operator's functions ([`LockAdmin`]) on the contender keys.

use std::collections::BTreeMap;
use std::time::Duration;

use etcd_client::{Compare, CompareOp, GetOptions, KeyValue, SortOrder, SortTarget};
use lock_core::{async_trait, AdminError, BackendError, LockAdmin, LockInfo, OwnerToken};

use crate::backend::EtcdBackend;
use crate::endpoints::Again;
use crate::layout::{
    contender_range, is_contender, lease_of_key, name_of_key, record_key, RECORDS,
};

/// Lists, inspects and force-releases locks in etcd's `Mutex` layout.
///
/// - `list_locks`: the names under the prefix that have a contender, each
///   with its holder (the lowest create revision). A holder written by
///   another client of the layout (`etcdctl lock`, Go's
///   `concurrency.Mutex`, whose value is empty) shows as `<etcd mutex>`.
/// - `inspect`: one name's holder, its lease's remaining ttl and its
///   create revision as the fencing token; for a free name, the token of
///   the last lock a withlock release or force release freed (a record
///   beside the layout; a lock that expired, or that another client
///   released, leaves none, and so does a release by a user without
///   rights on the records \[D3\]: a user who may not read them sees no
///   token for a free name). A withlock holder whose run ended before its
///   minimum hold \[H7\] shows [`LockInfo::minimum_hold_left`], its lease's
///   remaining ttl: the hold step moved its key onto a lease of the hold's
///   time left, so the key is on another lease than the one its name
///   (`<name>/<lease hex>`) gives, and that lease is revoked, which no
///   acquisition does (etcd's own clients always put their key on the
///   lease it names; a fair-queue waiter's key is on its ticket lease,
///   and the lease its name gives lives until it holds, see the crate
///   docs).
/// - `force_release`: deletes the holder's key (if it has not changed
///   since it was read) and revokes its lease, only when its value is a
///   withlock owner token \[D2\]: a holder of another client is refused.
///   The deletion reaches every waiter's watch.
///
/// `inspect` and `force_release` each end within the step timeout
/// ([`EtcdConfig::step_timeout`](crate::EtcdConfig::step_timeout)) with a
/// [`Timeout`](lock_core::BackendErrorKind::Timeout) error; `list_locks`
/// bounds each of its requests by it (the list reads one lease per held
/// lock), not the whole. A `force_release` that timed out before its
/// delete was sent changed nothing; one cut off after it may or may not
/// have freed the lock (read it again with `inspect`).
#[async_trait]
impl LockAdmin for EtcdBackend {
    async fn list_locks(&self, prefix: &str) -> Result<Vec<LockInfo>, BackendError> {
        let options = if prefix.is_empty() {
            GetOptions::new().with_all_keys()
        } else {
            GetOptions::new().with_prefix()
        };
        // Each request has its own step timeout, not the whole list: it
        // reads one lease per held lock.
        let read = self
            .step(
                "list_locks",
                self.call(Again::Yes, |mut client| {
                    let options = options.clone();
                    async move { client.get(prefix, Some(options)).await }
                }),
            )
            .await?;
        let mut holders: BTreeMap<String, KeyValue> = BTreeMap::new();
        for kv in read.kvs() {
            if kv.key().starts_with(RECORDS.as_bytes()) {
                continue;
            }
            let Some(name) = name_of_key(kv.key()) else {
                continue;
            };
            if !name.starts_with(prefix) {
                continue;
            }
            let lower = holders
                .get(name)
                .is_none_or(|held| kv.create_revision() < held.create_revision());
            if lower {
                holders.insert(name.to_owned(), kv.clone());
            }
        }
        let mut infos = Vec::with_capacity(holders.len());
        for (name, kv) in holders {
            infos.push(self.step("list_locks", self.info(name, &kv)).await?);
        }
        Ok(infos)
    }

    async fn inspect(&self, key: &str) -> Result<LockInfo, BackendError> {
        self.step("inspect", async {
            match self.holder(key).await? {
                Some(kv) => self.info(key.to_owned(), &kv).await,
                None => {
                    let record = self
                        .call(Again::Yes, |mut client| async move {
                            client.get(record_key(key), None).await
                        })
                        .await;
                    let record = match record {
                        // A user with rights on the lock names alone
                        // \[D3\] may not read the records: no token.
                        Err(error) if error.kind() == lock_core::BackendErrorKind::Setup => {
                            return Ok(LockInfo::free(key));
                        }
                        record => record?,
                    };
                    let token = record
                        .kvs()
                        .first()
                        .and_then(|kv| std::str::from_utf8(kv.value()).ok())
                        .and_then(|text| text.parse().ok());
                    Ok(LockInfo::free(key).with_fencing_token(token))
                }
            }
        })
        .await
    }

    async fn force_release(&self, key: &str) -> Result<Option<LockInfo>, AdminError> {
        let after = self.config().step_timeout;
        let freed = tokio::time::timeout(after, self.delete_holder(key))
            .await
            .map_err(|_| BackendError::timeout("force_release", after))??;
        let Some((info, lease)) = freed else {
            return Ok(None);
        };
        // The key is gone: the lease's revoke is tidying only, so its
        // failure (or its own timeout) does not undo the answer.
        let revoked = self
            .step(
                "force_release",
                self.call(Again::Yes, |mut client| async move {
                    client.lease_revoke(lease).await
                }),
            )
            .await;
        if let Err(error) = revoked {
            tracing::debug!(error = %lock_core::ErrorChain(&error), lease, "lease revoke failed; it expires with its ttl");
        }
        Ok(Some(info))
    }
}

impl EtcdBackend {
    /// Force release's deletion: the holder's key, if it is a withlock
    /// lock and has not changed since it was read; gives what it freed
    /// and the key's lease.
    async fn delete_holder(&self, key: &str) -> Result<Option<(LockInfo, i64)>, AdminError> {
        // A holder that changes between the read and the delete is read
        // again; three times is plenty for a name held by people.
        for _ in 0..3 {
            let Some(kv) = self.holder(key).await? else {
                return Ok(None);
            };
            let info = self.info(key.to_owned(), &kv).await?;
            if !info.is_withlock_lock() {
                return Err(AdminError::NotALock {
                    key: key.to_owned(),
                    found: "a holder that is not a withlock owner token (another client of \
                            etcd's lock layout)"
                        .to_owned(),
                });
            }
            let compares = vec![Compare::mod_revision(
                kv.key(),
                CompareOp::Equal,
                kv.mod_revision(),
            )];
            let answer = self
                .delete_contender(
                    key,
                    compares,
                    String::from_utf8_lossy(kv.key()).into_owned(),
                    u64::try_from(kv.create_revision()).unwrap_or(0),
                )
                .await?;
            if answer.succeeded() {
                return Ok(Some((info, kv.lease())));
            }
        }
        Err(AdminError::Backend(BackendError::message(
            lock_core::BackendErrorKind::Request,
            "the holder changed three times while it was being freed",
        )))
    }

    /// The contender of `name` with the lowest create revision.
    async fn holder(&self, name: &str) -> Result<Option<KeyValue>, BackendError> {
        let (start, end) = contender_range(name);
        let options = GetOptions::new()
            .with_range(end)
            .with_sort(SortTarget::Create, SortOrder::Ascend);
        let read = self
            .call(Again::Yes, |mut client| {
                let (start, options) = (start.clone(), options.clone());
                async move { client.get(start, Some(options)).await }
            })
            .await?;
        Ok(read
            .kvs()
            .iter()
            .find(|kv| is_contender(name, kv.key()))
            .cloned())
    }

    /// What the admin shows of a holder: its value, its lease's remaining
    /// ttl, its create revision; and, for a withlock holder whose key is on
    /// another lease than the one its name gives (the hold step moved it
    /// there \[H7\]), that ttl as the minimum hold's time left.
    async fn info(&self, name: String, kv: &KeyValue) -> Result<LockInfo, BackendError> {
        let ttl = if kv.lease() == 0 {
            None
        } else {
            let lease = kv.lease();
            let left = self
                .call(Again::Yes, |mut client| async move {
                    client.lease_time_to_live(lease, None).await
                })
                .await?
                .ttl();
            Some(Duration::from_secs(u64::try_from(left).unwrap_or(0)))
        };
        let owner = match std::str::from_utf8(kv.value()) {
            Ok("") => OwnerToken::from_value("<etcd mutex>"),
            Ok(value) => OwnerToken::from_value(value),
            Err(_) => OwnerToken::from_value("<bytes>"),
        };
        // [H7] Only the hold step leaves a holder's key on another lease
        // than its name gives, and that lease revoked. The other key on
        // another lease is a fair-queue waiter's, on its ticket lease
        // (the lease its name gives, its lock's, is unused until its
        // grant is taken up): when it is the lowest, it holds by a grant
        // not taken up yet, and the lease its name gives still lives.
        let named = lease_of_key(&name, kv.key()).filter(|named| *named != kv.lease());
        let kept = match named {
            Some(named) if kv.lease() != 0 && OwnerToken::is_well_formed(owner.as_str()) => {
                let named_left = self
                    .call(Again::Yes, |mut client| async move {
                        client.lease_time_to_live(named, None).await
                    })
                    .await?
                    .ttl();
                named_left < 0
            }
            _ => false,
        };
        Ok(LockInfo::held(name, owner, ttl)
            .with_fencing_token(u64::try_from(kv.create_revision()).ok())
            .with_minimum_hold_left(ttl.filter(|_| kept)))
    }
}
