//! The key layout of etcd's `concurrency.Mutex`: under the name `n`, one
//! key per contender, `n/<lease id in lower-case hex>`; the contender with
//! the lowest create revision holds.

/// Where a release keeps the fencing token of the lock it freed, for the
/// admin's view of a free name: outside every name's contender range
/// (a NUL byte first: no `Mutex` name starts with one), so no client of
/// the layout ever counts it as a contender.
pub(crate) fn record_key(name: &str) -> String {
    format!("{RECORDS}{name}")
}

/// The prefix of the [`record_key`]s.
pub(crate) const RECORDS: &str = "\0withlock/fencing/";

/// The key of the contender on `lease` for the lock `name`.
pub(crate) fn contender_key(name: &str, lease: i64) -> String {
    format!("{name}/{lease:x}")
}

/// The start and end (exclusive) of a range holding every contender key
/// of `name`: `name/0` up to `name/g`, which also holds keys of other
/// forms (`name/nightly/…` of a longer name): [`is_contender`] tells them
/// apart.
pub(crate) fn contender_range(name: &str) -> (String, String) {
    (format!("{name}/0"), format!("{name}/g"))
}

/// Whether `key` is a contender key of `name`: `name/` followed by
/// lower-case hex digits only (a lease id as `%x` writes it), so that the
/// contenders of a longer name (`name/nightly/<hex>`, whose own prefix
/// starts with `name/`) are not counted as contenders of `name`.
pub(crate) fn is_contender(name: &str, key: &[u8]) -> bool {
    lease_of_key(name, key).is_some()
}

/// The lease id a contender key of `name` names.
pub(crate) fn lease_of_key(name: &str, key: &[u8]) -> Option<i64> {
    let rest = key.strip_prefix(name.as_bytes())?.strip_prefix(b"/")?;
    if rest.is_empty()
        || rest.len() > 16
        || !rest.iter().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    {
        return None;
    }
    let text = std::str::from_utf8(rest).ok()?;
    u64::from_str_radix(text, 16)
        .ok()
        .and_then(|id| i64::try_from(id).ok())
}

/// The name a contender key belongs to: the key without its last
/// `/<hex>` part.
pub(crate) fn name_of_key(key: &[u8]) -> Option<&str> {
    let key = std::str::from_utf8(key).ok()?;
    let (name, _) = key.rsplit_once('/')?;
    lease_of_key(name, key.as_bytes()).map(|_| name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contenders_are_the_names_own_hex_keys_only() {
        assert_eq!(contender_key("jobs", 0x694d_7a3c_1f2e), "jobs/694d7a3c1f2e");
        assert!(is_contender("jobs", b"jobs/694d7a3c1f2e"));
        assert_eq!(lease_of_key("jobs", b"jobs/ff"), Some(255));
        for other in [
            &b"jobs/nightly/694d"[..],
            b"jobs/",
            b"jobs/ABC",
            b"jobsx/abc",
            b"jobs/abc/def",
            b"jobs/ffffffffffffffffff",
        ] {
            assert!(!is_contender("jobs", other), "{other:?}");
        }
        let (start, end) = contender_range("jobs");
        assert!(start.as_str() <= "jobs/0" && "jobs/ffff" < end.as_str());
        assert_eq!(name_of_key(b"jobs/nightly/1a"), Some("jobs/nightly"));
        assert_eq!(name_of_key(b"a b/{}*/1a"), Some("a b/{}*"));
        assert_eq!(name_of_key(b"jobs/nightly"), None);
    }
}
