//! How locks, keys and durations are shown: text for people, JSON for
//! scripts.

use std::fmt;
use std::time::{Duration, SystemTime};

use serde_json::{json, Value};

use lock_core::LockInfo;

/// A duration the way a person reads it: `850ms`, `28.5s`, `5m 30s`.
pub(crate) fn ttl_text(d: Duration) -> String {
    if d < Duration::from_secs(1) {
        format!("{}ms", d.as_millis())
    } else if d < Duration::from_secs(100) {
        format!("{:.1}s", d.as_secs_f64())
    } else {
        humantime::format_duration(Duration::from_secs(d.as_secs())).to_string()
    }
}

/// A key as text: verbatim, unless it has control characters (a newline
/// would break a table), which are escaped.
pub(crate) struct Shown<'a>(pub(crate) &'a str);

impl fmt::Display for Shown<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.chars().any(char::is_control) {
            write!(f, "{}", self.0.escape_debug())
        } else {
            f.write_str(self.0)
        }
    }
}

/// A duration in whole milliseconds, for JSON.
fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// When a lock kept by its minimum hold \[H7\] is let go, by this host's
/// clock read at `now`: `2025-06-01T03:05:00Z`.
fn kept_until(now: SystemTime, left: Duration) -> String {
    // Rounded up: the key is not free before.
    let left = Duration::from_secs(left.as_secs() + u64::from(left.subsec_nanos() > 0));
    humantime::format_rfc3339_seconds(now + left).to_string()
}

/// What a lock kept by its minimum hold shows after its holder: `kept
/// until 2025-06-01T03:05:00Z (4m 58s left) after its run ended`; `None`
/// for any other.
pub(crate) fn kept_text(view: &LockInfo, now: SystemTime) -> Option<String> {
    let left = view.minimum_hold_left.filter(|_| view.is_kept())?;
    Some(format!(
        "kept until {} ({} left) after its run ended",
        kept_until(now, left),
        ttl_text(left)
    ))
}

/// One lock as a JSON object: `{"key", "held", "node_id", "owner",
/// "ttl_ms", "fencing_token", "held_for_ms", "last_owner", "kept_until",
/// "minimum_hold_left_ms"}` (`held_for_ms` and `last_owner` where the
/// store records them; the last two for a lock whose run ended before its
/// minimum hold, the first as RFC 3339 by this host's clock at `now`;
/// else null).
pub(crate) fn view_json(view: &LockInfo, now: SystemTime) -> Value {
    let kept = view.minimum_hold_left.filter(|_| view.is_kept());
    json!({
        "key": view.key,
        "held": view.owner.is_some(),
        "node_id": view.node_id(),
        "owner": view.owner.as_ref().map(|o| o.as_str()),
        "ttl_ms": view.ttl.map(millis),
        "fencing_token": view.fencing_token,
        "held_for_ms": view.held_for.map(millis),
        "last_owner": view.last_owner.as_ref().map(|o| o.as_str()),
        "kept_until": kept.map(|left| kept_until(now, left)),
        "minimum_hold_left_ms": kept.map(millis),
    })
}

/// The remaining ttl column of a held lock.
fn ttl_cell(view: &LockInfo) -> String {
    view.ttl.map_or_else(|| "no expiry".to_owned(), ttl_text)
}

/// The locks as a table with a header, columns aligned. When a lock is
/// kept by its minimum hold \[H7\], a last column `KEPT UNTIL` says until
/// when (by this host's clock at `now`), empty for the running ones.
pub(crate) fn table(views: &[LockInfo], now: SystemTime) -> String {
    let any_kept = views.iter().any(LockInfo::is_kept);
    let rows: Vec<Vec<String>> = views
        .iter()
        .map(|v| {
            let mut row = vec![
                Shown(&v.key).to_string(),
                v.node_id()
                    .map_or_else(String::new, |n| Shown(n).to_string()),
                ttl_cell(v),
                v.fencing_token
                    .map_or_else(|| "-".to_owned(), |t| t.to_string()),
            ];
            if any_kept {
                row.push(
                    v.minimum_hold_left
                        .filter(|_| v.is_kept())
                        .map_or_else(String::new, |left| kept_until(now, left)),
                );
            }
            row
        })
        .collect();
    let mut header: Vec<String> = ["KEY", "NODE", "TTL", "TOKEN"].map(str::to_owned).into();
    if any_kept {
        header.push("KEPT UNTIL".to_owned());
    }
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in &rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    for row in std::iter::once(&header).chain(&rows) {
        let line = row
            .iter()
            .zip(&widths)
            .map(|(cell, &width)| format!("{cell:<width$}"))
            .collect::<Vec<_>>()
            .join("  ");
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// One key as `label: value` lines; a lock kept by its minimum hold
/// \[H7\] has a `kept until` line (by this host's clock at `now`).
pub(crate) fn details(view: &LockInfo, now: SystemTime) -> String {
    let token = view
        .fencing_token
        .map_or_else(|| "none drawn yet".to_owned(), |t| t.to_string());
    let mut out = format!("key:                {}\n", Shown(&view.key));
    match &view.owner {
        Some(owner) => {
            out.push_str(&format!("held by:            {}\n", Shown(owner.node_id())));
            out.push_str(&format!("owner token:        {}\n", Shown(owner.as_str())));
            out.push_str(&format!("ttl:                {}\n", ttl_cell(view)));
            if let Some(held_for) = view.held_for {
                out.push_str(&format!("held for:           {}\n", ttl_text(held_for)));
            }
            if let Some(left) = view.minimum_hold_left.filter(|_| view.is_kept()) {
                out.push_str(&format!(
                    "kept until:         {} ({} left) after its run ended (minimum hold)\n",
                    kept_until(now, left),
                    ttl_text(left)
                ));
            }
        }
        None => {
            out.push_str("held by:            nobody (free)\n");
            if let Some(last) = &view.last_owner {
                out.push_str(&format!("last holder:        {}\n", Shown(last.as_str())));
            }
        }
    }
    out.push_str(&format!("last fencing token: {token}\n"));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use lock_core::OwnerToken;

    fn held(key: &str, node: &str, ms: u64, token: u64) -> LockInfo {
        LockInfo::held(
            key,
            OwnerToken::from_value(format!("{node}/0123456789abcdef0123456789abcdef")),
            Some(Duration::from_millis(ms)),
        )
        .with_fencing_token(Some(token))
    }

    #[test]
    fn durations_read_naturally() {
        assert_eq!(ttl_text(Duration::from_millis(850)), "850ms");
        assert_eq!(ttl_text(Duration::from_millis(28_460)), "28.5s");
        assert_eq!(ttl_text(Duration::from_secs(330)), "5m 30s");
    }

    /// 2025-06-01T03:00:00Z.
    fn at() -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_748_746_800)
    }

    #[test]
    fn tables_align_and_escape() {
        let text = table(
            &[held("a", "web-1", 1500, 7), held("long\nkey", "w2", 90, 12)],
            at(),
        );
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3);
        assert_eq!(lines[0], "KEY        NODE   TTL   TOKEN");
        assert_eq!(lines[1], "a          web-1  1.5s  7");
        assert_eq!(lines[2], "long\\nkey  w2     90ms  12");
    }

    #[test]
    fn json_has_every_field() {
        let value = view_json(&held("k", "n", 2000, 3), at());
        assert_eq!(value["held"], true);
        assert_eq!(value["node_id"], "n");
        assert_eq!(value["ttl_ms"], 2000);
        assert_eq!(value["fencing_token"], 3);
        assert!(value["kept_until"].is_null() && value["minimum_hold_left_ms"].is_null());
        let free = LockInfo::free("k");
        let value = view_json(&free, at());
        assert_eq!(value["held"], false);
        assert!(value["owner"].is_null() && value["ttl_ms"].is_null());
        assert!(details(&free, at()).contains("nobody"));
    }

    /// \[H7\] A lock kept by its minimum hold says until when, rounded up
    /// to the second, in every form; a running one says nothing of it.
    #[test]
    fn a_kept_lock_says_until_when() {
        let left = Duration::from_millis(298_200);
        let kept = held("nightly", "web-2", 298_200, 9).with_minimum_hold_left(Some(left));
        assert_eq!(
            kept_text(&kept, at()).unwrap(),
            "kept until 2025-06-01T03:04:59Z (4m 58s left) after its run ended"
        );
        assert_eq!(kept_text(&held("k", "n", 100, 1), at()), None);
        let value = view_json(&kept, at());
        assert_eq!(value["kept_until"], "2025-06-01T03:04:59Z");
        assert_eq!(value["minimum_hold_left_ms"], 298_200);
        assert!(details(&kept, at()).contains(
            "kept until:         2025-06-01T03:04:59Z (4m 58s left) after its run ended"
        ));
        assert!(!details(&held("k", "n", 100, 1), at()).contains("kept"));
        let text = table(&[held("a", "web-1", 1500, 7), kept], at());
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "KEY      NODE   TTL     TOKEN  KEPT UNTIL");
        assert_eq!(lines[1], "a        web-1  1.5s    7");
        assert_eq!(
            lines[2],
            "nightly  web-2  4m 58s  9      2025-06-01T03:04:59Z"
        );
    }
}
