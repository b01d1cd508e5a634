//! Passwords out of the text of a store's error, before it is shown or
//! logged: a store's driver may name the URL it was given, or a
//! connection string, in its messages.
//!
//! Two shapes are covered: the password of a URL's userinfo
//! (`redis://user:secret@host`, `postgres://:secret@host`) and a
//! `password=` setting (`host=h password=secret`, `?password=secret`,
//! `data_password=secret`, a quoted `password='se cret'`). The password
//! becomes `<redacted>`; the user name, host and the rest stay.

use std::borrow::Cow;

const REDACTED: &str = "<redacted>";

/// `text` with every password it carries replaced by `<redacted>`;
/// borrowed when there is none.
pub(crate) fn redact(text: &str) -> Cow<'_, str> {
    let first = redact_userinfo(text);
    if let Cow::Owned(both) = redact_settings(&first) {
        return Cow::Owned(both);
    }
    first
}

/// Whether `c` ends a URL in running text.
fn ends_url(c: char) -> bool {
    c.is_whitespace() || matches!(c, '"' | '\'' | '`' | '<' | '>')
}

/// The password of every `scheme://user:password@` replaced. The
/// userinfo runs to the last `@` before the URL ends (a password may hold
/// a raw `@`, `/` or `,`, as the CLI accepts them), and its password from
/// its first `:`.
fn redact_userinfo(text: &str) -> Cow<'_, str> {
    let mut out = String::new();
    let mut copied = 0;
    let mut from = 0;
    while let Some(found) = text[from..].find("://") {
        let start = from + found + 3;
        let end = text[start..]
            .find(ends_url)
            .map_or(text.len(), |n| start + n);
        from = end.max(start);
        let Some(at) = text[start..end].rfind('@') else {
            continue;
        };
        let userinfo = &text[start..start + at];
        let Some(colon) = userinfo.find(':') else {
            continue;
        };
        let password = start + colon + 1;
        if password == start + at {
            continue; // `user:@`: no password
        }
        out.push_str(&text[copied..password]);
        out.push_str(REDACTED);
        copied = start + at;
    }
    if copied == 0 {
        return Cow::Borrowed(text);
    }
    out.push_str(&text[copied..]);
    Cow::Owned(out)
}

/// The value of every `password=` setting replaced: to the closing quote
/// of a quoted value, else to the first space, `&`, `,` or `;`. The
/// setting's name may end in `password` (`data_password=`) and be in any
/// case.
fn redact_settings(text: &str) -> Cow<'_, str> {
    const NAME: &str = "password";
    let lower = text.to_ascii_lowercase();
    let mut out = String::new();
    let mut copied = 0;
    let mut from = 0;
    while let Some(found) = lower[from..].find(NAME) {
        let name_end = from + found + NAME.len();
        from = name_end;
        let rest = &text[name_end..];
        let spaces = rest.len() - rest.trim_start_matches(' ').len();
        let after_spaces = &rest[spaces..];
        let Some(value) = after_spaces.strip_prefix('=') else {
            continue;
        };
        let value_start = text.len() - value.trim_start_matches(' ').len();
        let value = &text[value_start..];
        let value_len = match value.strip_prefix('\'') {
            // libpq's quoting: `\'` and `\\` inside.
            Some(quoted) => {
                let mut escaped = false;
                let close = quoted.char_indices().find(|&(_, c)| {
                    let closes = c == '\'' && !escaped;
                    escaped = c == '\\' && !escaped;
                    closes
                });
                close.map_or(value.len(), |(i, _)| i + 2)
            }
            None => value
                .find(|c: char| c.is_whitespace() || matches!(c, '&' | ',' | ';'))
                .unwrap_or(value.len()),
        };
        if value_len == 0 {
            continue;
        }
        out.push_str(&text[copied..value_start]);
        out.push_str(REDACTED);
        copied = value_start + value_len;
        from = copied;
    }
    if copied == 0 {
        return Cow::Borrowed(text);
    }
    out.push_str(&text[copied..]);
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::redact;

    #[test]
    fn url_passwords_are_redacted() {
        for (text, shown) in [
            (
                "connect to redis://app:hunter2@10.0.0.1:6379/0 failed",
                "connect to redis://app:<redacted>@10.0.0.1:6379/0 failed",
            ),
            (
                "postgres://:hunter2@db/test",
                "postgres://:<redacted>@db/test",
            ),
            // A raw `@` or `/` in the password, as the CLI accepts.
            (
                "url \"redis://u:p@ss/w@h:1\" refused",
                "url \"redis://u:<redacted>@h:1\" refused",
            ),
            (
                "a redis://h:1 and etcd://root:pw@e:2379,e2:2379 b",
                "a redis://h:1 and etcd://root:<redacted>@e:2379,e2:2379 b",
            ),
        ] {
            assert_eq!(redact(text), shown);
        }
    }

    #[test]
    fn password_settings_are_redacted() {
        for (text, shown) in [
            (
                "host=db password=hunter2 user=app",
                "host=db password=<redacted> user=app",
            ),
            (
                "postgres://db/test?user=app&password=hunter2&sslmode=off",
                "postgres://db/test?user=app&password=<redacted>&sslmode=off",
            ),
            (
                "redis+sentinel://s:1/m?data_password=hunter2",
                "redis+sentinel://s:1/m?data_password=<redacted>",
            ),
            (
                r"PASSWORD = 'hunter 2\'x' host=h",
                "PASSWORD = <redacted> host=h",
            ),
        ] {
            assert_eq!(redact(text), shown);
        }
    }

    #[test]
    fn text_without_a_password_is_untouched() {
        for text in [
            "CLUSTERDOWN The cluster is down",
            "WRONGPASS invalid username-password pair or user is disabled.",
            "etcdserver: authentication failed, invalid user ID or password",
            "redis://127.0.0.1:6379/0",
            "mailto://user@host",
            "password: the password is wrong",
        ] {
            assert!(
                matches!(redact(text), std::borrow::Cow::Borrowed(_)),
                "{text}"
            );
        }
    }
}
