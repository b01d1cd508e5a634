//! How locks, keys and durations are shown: text for people, JSON for
//! scripts.

use std::fmt;
use std::time::Duration;

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

/// One lock as a JSON object: `{"key", "held", "node_id", "owner",
/// "ttl_ms", "fencing_token", "held_for_ms", "last_owner"}` (the last two
/// where the store records them, else null).
pub(crate) fn view_json(view: &LockInfo) -> Value {
    json!({
        "key": view.key,
        "held": view.owner.is_some(),
        "node_id": view.node_id(),
        "owner": view.owner.as_ref().map(|o| o.as_str()),
        "ttl_ms": view.ttl.map(|t| u64::try_from(t.as_millis()).unwrap_or(u64::MAX)),
        "fencing_token": view.fencing_token,
        "held_for_ms": view.held_for.map(|t| u64::try_from(t.as_millis()).unwrap_or(u64::MAX)),
        "last_owner": view.last_owner.as_ref().map(|o| o.as_str()),
    })
}

/// The remaining ttl column of a held lock.
fn ttl_cell(view: &LockInfo) -> String {
    view.ttl.map_or_else(|| "no expiry".to_owned(), ttl_text)
}

/// The locks as a table with a header, columns aligned.
pub(crate) fn table(views: &[LockInfo]) -> String {
    let rows: Vec<[String; 4]> = views
        .iter()
        .map(|v| {
            [
                Shown(&v.key).to_string(),
                v.node_id()
                    .map_or_else(String::new, |n| Shown(n).to_string()),
                ttl_cell(v),
                v.fencing_token
                    .map_or_else(|| "-".to_owned(), |t| t.to_string()),
            ]
        })
        .collect();
    let header = ["KEY", "NODE", "TTL", "TOKEN"].map(str::to_owned);
    let mut widths = header.clone().map(|h| h.chars().count());
    for row in &rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    for row in std::iter::once(&header).chain(&rows) {
        let line = row
            .iter()
            .zip(widths)
            .map(|(cell, width)| format!("{cell:<width$}"))
            .collect::<Vec<_>>()
            .join("  ");
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// One key as `label: value` lines.
pub(crate) fn details(view: &LockInfo) -> String {
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

    #[test]
    fn tables_align_and_escape() {
        let text = table(&[held("a", "web-1", 1500, 7), held("long\nkey", "w2", 90, 12)]);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3);
        assert_eq!(lines[0], "KEY        NODE   TTL   TOKEN");
        assert_eq!(lines[1], "a          web-1  1.5s  7");
        assert_eq!(lines[2], "long\\nkey  w2     90ms  12");
    }

    #[test]
    fn json_has_every_field() {
        let value = view_json(&held("k", "n", 2000, 3));
        assert_eq!(value["held"], true);
        assert_eq!(value["node_id"], "n");
        assert_eq!(value["ttl_ms"], 2000);
        assert_eq!(value["fencing_token"], 3);
        let free = LockInfo::free("k");
        let value = view_json(&free);
        assert_eq!(value["held"], false);
        assert!(value["owner"].is_null() && value["ttl_ms"].is_null());
        assert!(details(&free).contains("nobody"));
    }
}
