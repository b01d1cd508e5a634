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
            self.validate()?;
            return redis::Client::build_with_tls(info, certificates.clone())
                .map(|client| client.get_connection_info().clone())
                .map_err(SetupError::Tls);
        }
        Ok(info)
    }

    /// Refuses a CA "certificate" with no certificate in it (the `redis`
    /// crate would trust nothing, and every handshake would fail later).
    #[cfg(feature = "tls")]
    pub(crate) fn validate(&self) -> Result<(), SetupError> {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::CertificateDer;
        let Some(pem) = self
            .certificates
            .as_ref()
            .and_then(|c| c.root_cert.as_ref())
        else {
            return Ok(());
        };
        let mut found = 0;
        for certificate in CertificateDer::pem_slice_iter(pem) {
            certificate.map_err(|e| {
                SetupError::Tls(redis::RedisError::from((
                    redis::ErrorKind::InvalidClientConfig,
                    "the CA certificate is not valid PEM",
                    e.to_string(),
                )))
            })?;
            found += 1;
        }
        if found == 0 {
            return Err(SetupError::Tls(redis::RedisError::from((
                redis::ErrorKind::InvalidClientConfig,
                "the CA certificate PEM holds no certificate",
            ))));
        }
        Ok(())
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
