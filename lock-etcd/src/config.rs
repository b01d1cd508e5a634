//! The backend's configuration: where etcd is, how to log in, how long a
//! step may take.

use std::fmt;
use std::time::Duration;

use crate::error::SetupError;

/// How an [`EtcdBackend`](crate::EtcdBackend) reaches etcd.
///
/// | field | default |
/// |---|---|
/// | [`endpoints`](Self::endpoints) | `["http://127.0.0.1:2379"]` |
/// | [`user`](Self::user) | none (no authentication) |
/// | [`step_timeout`](Self::step_timeout) | 2 s |
/// | [`connect_timeout`](Self::connect_timeout) | 2 s |
/// | [`failover_timeout`](Self::failover_timeout) | 1 s |
/// | [`release_notifications`](Self::release_notifications) | on |
/// | [`min_ttl`](Self::min_ttl) | measured at connect |
///
/// `Debug` never shows the password.
#[derive(Clone)]
#[non_exhaustive]
pub struct EtcdConfig {
    /// The cluster's client URLs (`http://host:2379`, `https://…` with
    /// TLS). The backend talks to one at a time, the first to begin with,
    /// and moves to the next (wrapping around) when it fails: see
    /// [`failover_timeout`](Self::failover_timeout).
    ///
    /// Default: `["http://127.0.0.1:2379"]`.
    pub endpoints: Vec<String>,
    /// The user name and password of etcd's authentication, when it is on.
    ///
    /// Default: none.
    pub user: Option<(String, String)>,
    /// TLS to the endpoints (with the `tls` feature): the CA to check the
    /// servers against, and a client certificate where etcd asks for one.
    ///
    /// Default: none (plain connections).
    #[cfg(feature = "tls")]
    pub tls: Option<etcd_client::TlsOptions>,
    /// How long one step (one request, or the requests of one lock step)
    /// may take before it fails with a timeout.
    ///
    /// Default: 2 s.
    pub step_timeout: Duration,
    /// How long a request may wait for the endpoint in use before the
    /// backend moves to the next endpoint of the list. A request whose
    /// connection fails (refused, reset, found dead by the HTTP/2 pings,
    /// or a member without a leader) moves it at
    /// once. Reads and keep-alives are then sent again on the new
    /// endpoint within the same step; a step that cannot be sent twice (a
    /// release's or a minimum hold's conditional write) waits on for the
    /// rest of its step timeout. The keep-alive and watch streams move
    /// with the endpoint. Capped at the step timeout.
    ///
    /// Default: 1 s.
    pub failover_timeout: Duration,
    /// How long [`EtcdBackend::connect`](crate::EtcdBackend::connect) waits
    /// for the cluster to answer its checks.
    ///
    /// Default: 2 s.
    pub connect_timeout: Duration,
    /// Waiters learn of releases from a watch on the name (one watch stream
    /// per backend). Off: they poll on their retry timer.
    ///
    /// Default: on.
    pub release_notifications: bool,
    /// The shortest lease the backend grants. etcd raises a shorter lease
    /// to its own floor (one and a half election timeouts, 1.5 s with
    /// etcd's default 1 s election timeout, so 2 s in whole seconds),
    /// silently: `None` measures that floor at connect by granting a 1 s
    /// lease and reading the ttl etcd gave it.
    ///
    /// Default: `None` (measured).
    pub min_ttl: Option<Duration>,
}

impl Default for EtcdConfig {
    fn default() -> Self {
        Self {
            endpoints: vec!["http://127.0.0.1:2379".to_owned()],
            user: None,
            #[cfg(feature = "tls")]
            tls: None,
            step_timeout: Duration::from_secs(2),
            connect_timeout: Duration::from_secs(2),
            failover_timeout: Duration::from_secs(1),
            release_notifications: true,
            min_ttl: None,
        }
    }
}

impl EtcdConfig {
    /// The default config on `endpoints`.
    pub fn new<S: Into<String>>(endpoints: impl IntoIterator<Item = S>) -> Self {
        Self::default().endpoints(endpoints)
    }

    /// A config from a URL of the form
    /// `etcd://[user:password@]host:2379[,host2:2379…]`, or `etcds://…`
    /// for TLS (with the `tls` feature; the servers' certificates are
    /// checked against the system's roots unless `tls` is
    /// set after). The other fields keep their defaults.
    ///
    /// # Errors
    ///
    /// [`SetupError::InvalidUrl`] (never showing the password).
    pub fn from_url(url: &str) -> Result<Self, SetupError> {
        let bad = |reason: &'static str| SetupError::InvalidUrl { reason };
        let (scheme, rest) = url
            .split_once("://")
            .ok_or(bad("it has no scheme: write etcd://host:2379"))?;
        let http = match scheme {
            "etcd" => "http",
            "etcds" => "https",
            _ => return Err(bad("the scheme is neither etcd:// nor etcds://")),
        };
        let rest = rest.trim_end_matches('/');
        let (user, hosts) = match rest.rsplit_once('@') {
            Some((user, hosts)) => {
                let (name, password) = user
                    .split_once(':')
                    .ok_or(bad("its user part has no password: write user:password@"))?;
                if name.is_empty() {
                    return Err(bad("its user name is empty"));
                }
                (
                    Some((percent_decode(name)?, percent_decode(password)?)),
                    hosts,
                )
            }
            None => (None, rest),
        };
        if hosts.contains('/') || hosts.contains('?') {
            return Err(bad("it has a path or a query; etcd URLs have neither"));
        }
        let mut endpoints = Vec::new();
        for host in hosts.split(',') {
            if host.is_empty() {
                return Err(bad("it names an empty host"));
            }
            let with_port = if host.rsplit_once(':').is_some_and(|(_, p)| {
                !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) && !p.contains(']')
            }) {
                host.to_owned()
            } else {
                format!("{host}:2379")
            };
            endpoints.push(format!("{http}://{with_port}"));
        }
        #[cfg(not(feature = "tls"))]
        if http == "https" {
            return Err(bad("etcds:// needs the `tls` feature of lock-etcd"));
        }
        let config = Self {
            endpoints,
            user,
            ..Self::default()
        };
        #[cfg(feature = "tls")]
        let config = if http == "https" {
            config.tls(etcd_client::TlsOptions::new().with_enabled_roots())
        } else {
            config
        };
        Ok(config)
    }

    /// Sets [`endpoints`](Self::endpoints). Defaults to
    /// `["http://127.0.0.1:2379"]`.
    #[must_use]
    pub fn endpoints<S: Into<String>>(mut self, endpoints: impl IntoIterator<Item = S>) -> Self {
        self.endpoints = endpoints.into_iter().map(Into::into).collect();
        self
    }

    /// Sets [`user`](Self::user). Defaults to none.
    #[must_use]
    pub fn user(mut self, name: impl Into<String>, password: impl Into<String>) -> Self {
        self.user = Some((name.into(), password.into()));
        self
    }

    /// Sets [`tls`](Self::tls). Defaults to none.
    #[cfg(feature = "tls")]
    #[must_use]
    pub fn tls(mut self, tls: etcd_client::TlsOptions) -> Self {
        self.tls = Some(tls);
        self
    }

    /// Sets [`step_timeout`](Self::step_timeout). Defaults to 2 s.
    #[must_use]
    pub fn step_timeout(mut self, timeout: Duration) -> Self {
        self.step_timeout = timeout;
        self
    }

    /// Sets [`connect_timeout`](Self::connect_timeout). Defaults to 2 s.
    #[must_use]
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Sets [`failover_timeout`](Self::failover_timeout). Defaults to 1 s.
    #[must_use]
    pub fn failover_timeout(mut self, timeout: Duration) -> Self {
        self.failover_timeout = timeout;
        self
    }

    /// Sets [`release_notifications`](Self::release_notifications).
    /// Defaults to on.
    #[must_use]
    pub fn release_notifications(mut self, on: bool) -> Self {
        self.release_notifications = on;
        self
    }

    /// Sets [`min_ttl`](Self::min_ttl), rounded up to whole seconds.
    /// Defaults to measured at connect.
    #[must_use]
    pub fn min_ttl(mut self, min_ttl: Duration) -> Self {
        self.min_ttl = Some(min_ttl);
        self
    }

    /// Checks every field.
    ///
    /// # Errors
    ///
    /// [`SetupError::InvalidConfig`] naming the field.
    pub fn validate(&self) -> Result<(), SetupError> {
        let invalid = |field, reason| Err(SetupError::InvalidConfig { field, reason });
        if self.endpoints.is_empty() {
            return invalid("endpoints", "is empty");
        }
        if self
            .endpoints
            .iter()
            .any(|e| !(e.starts_with("http://") || e.starts_with("https://")))
        {
            return invalid("endpoints", "must be http:// or https:// URLs");
        }
        if self.step_timeout.is_zero() {
            return invalid("step_timeout", "is zero");
        }
        if self.connect_timeout.is_zero() {
            return invalid("connect_timeout", "is zero");
        }
        if self.failover_timeout.is_zero() {
            return invalid("failover_timeout", "is zero");
        }
        if self.min_ttl.is_some_and(|t| t.is_zero()) {
            return invalid("min_ttl", "is zero");
        }
        Ok(())
    }
}

/// Decodes `%XX` escapes of a URL's user part.
fn percent_decode(text: &str) -> Result<String, SetupError> {
    let bad = SetupError::InvalidUrl {
        reason: "its user part has a bad % escape",
    };
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = text.get(i + 1..i + 3).ok_or(SetupError::InvalidUrl {
                reason: "its user part has a bad % escape",
            })?;
            let byte = u8::from_str_radix(hex, 16).map_err(|_| SetupError::InvalidUrl {
                reason: "its user part has a bad % escape",
            })?;
            out.push(byte);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| bad)
}

impl fmt::Debug for EtcdConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("EtcdConfig");
        d.field("endpoints", &self.endpoints)
            .field("user", &self.user.as_ref().map(|(name, _)| name));
        #[cfg(feature = "tls")]
        d.field("tls", &self.tls.is_some());
        d.field("step_timeout", &self.step_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("failover_timeout", &self.failover_timeout)
            .field("release_notifications", &self.release_notifications)
            .field("min_ttl", &self.min_ttl)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_give_endpoints_and_credentials() {
        let c = EtcdConfig::from_url("etcd://a:2379,b,c:32379").unwrap();
        assert_eq!(
            c.endpoints,
            ["http://a:2379", "http://b:2379", "http://c:32379"]
        );
        assert!(c.user.is_none());
        let c = EtcdConfig::from_url("etcd://app:p%40ss@127.0.0.1:2379/").unwrap();
        assert_eq!(c.user, Some(("app".to_owned(), "p@ss".to_owned())));
        assert!(!format!("{c:?}").contains("p@ss"));
        for bad in [
            "127.0.0.1:2379",
            "redis://h",
            "etcd://",
            "etcd://a,,b",
            "etcd://u@h",
            "etcd://h/path",
            "etcd://u:%zz@h",
        ] {
            assert!(
                matches!(
                    EtcdConfig::from_url(bad),
                    Err(SetupError::InvalidUrl { .. })
                ),
                "{bad}"
            );
        }
    }

    #[test]
    fn validation_names_the_field() {
        assert!(EtcdConfig::default().validate().is_ok());
        let e = EtcdConfig::default()
            .endpoints(Vec::<String>::new())
            .validate();
        assert!(matches!(
            e,
            Err(SetupError::InvalidConfig {
                field: "endpoints",
                ..
            })
        ));
        let e = EtcdConfig::default()
            .step_timeout(Duration::ZERO)
            .validate();
        assert!(matches!(
            e,
            Err(SetupError::InvalidConfig {
                field: "step_timeout",
                ..
            })
        ));
    }
}
