//! The certificates a backend trusts for `rediss://` connections, beyond
//! the system's roots: one place that puts them on the connection infos of
//! the single-node, Cluster and Sentinel backends. Without the `tls`
//! feature there are never any, and `rediss://` URLs do not parse.

use redis::ConnectionInfo;

use crate::config::SetupError;

/// The certificates given for TLS connections, if any.
#[derive(Clone, Default)]
pub(crate) struct Trust {
    #[cfg(feature = "tls")]
    certificates: Option<redis::TlsCertificates>,
}

impl Trust {
    /// The system's roots only (or no TLS at all).
    pub(crate) fn system() -> Self {
        Self::default()
    }

    /// `certificates` (a CA's PEM, perhaps a client certificate) instead of
    /// the system's roots.
    #[cfg(feature = "tls")]
    pub(crate) fn custom(certificates: redis::TlsCertificates) -> Self {
        Self {
            certificates: Some(certificates),
        }
    }

    /// Whether certificates were given.
    pub(crate) fn is_custom(&self) -> bool {
        #[cfg(feature = "tls")]
        {
            self.certificates.is_some()
        }
        #[cfg(not(feature = "tls"))]
        {
            false
        }
    }

    /// `info` with the certificates on it. Certificates given for a
    /// `redis://` (not TLS) address are refused rather than ignored, so a
    /// user never believes a plain connection is protected.
    pub(crate) fn apply(&self, info: ConnectionInfo) -> Result<ConnectionInfo, SetupError> {
        #[cfg(feature = "tls")]
        if let Some(certificates) = &self.certificates {
            return redis::Client::build_with_tls(info, certificates.clone())
                .map(|client| client.get_connection_info().clone())
                .map_err(SetupError::Tls);
        }
        Ok(info)
    }

    /// The certificates, for a builder of the `redis` crate.
    #[cfg(feature = "tls")]
    pub(crate) fn certificates(&self) -> Option<&redis::TlsCertificates> {
        self.certificates.as_ref()
    }

    /// What `Debug` shows: never the certificates themselves.
    pub(crate) fn describe(&self) -> &'static str {
        if self.is_custom() {
            "custom certificates"
        } else {
            "system roots"
        }
    }
}
