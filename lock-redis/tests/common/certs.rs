//! A CA and a server certificate for `127.0.0.1` and `localhost`, made at
//! run time with rcgen, in a temporary directory removed on drop.
#![allow(dead_code, unreachable_pub)]

use std::path::PathBuf;

use lock_redis::redis::TlsCertificates;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};
use withlock_test_servers::redis::TlsFiles;

/// A private CA and the certificate it signed for the test servers.
pub struct TestPki {
    dir: PathBuf,
    /// The PEM files a TLS `redis-server` is started with.
    pub files: TlsFiles,
    /// The CA's certificate, PEM.
    pub ca_pem: Vec<u8>,
}

/// A self-signed CA: its certificate and key.
fn ca(name: &str) -> (rcgen::Certificate, KeyPair) {
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    (params.self_signed(&key).unwrap(), key)
}

impl TestPki {
    /// A new CA and a server certificate signed by it.
    pub fn new() -> Self {
        let (ca_cert, ca_key) = ca("withlock test CA");
        let key = KeyPair::generate().unwrap();
        let mut params =
            CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()]).unwrap();
        params
            .distinguished_name
            .push(DnType::CommonName, "withlock test server");
        // Servers use it as clients too (replication, cluster bus).
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let cert = params.signed_by(&key, &ca_cert, &ca_key).unwrap();
        let dir = std::env::temp_dir().join(format!("withlock-pki-{:016x}", rand::random::<u64>()));
        std::fs::create_dir_all(&dir).unwrap();
        let files = TlsFiles {
            cert: dir.join("server.crt"),
            key: dir.join("server.key"),
            ca: dir.join("ca.crt"),
        };
        std::fs::write(&files.cert, cert.pem()).unwrap();
        std::fs::write(&files.key, key.serialize_pem()).unwrap();
        std::fs::write(&files.ca, ca_cert.pem()).unwrap();
        Self {
            dir,
            files,
            ca_pem: ca_cert.pem().into_bytes(),
        }
    }

    /// Certificates that trust this CA.
    pub fn certificates(&self) -> TlsCertificates {
        trusting(self.ca_pem.clone())
    }
}

impl Drop for TestPki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Certificates that trust only the CA `ca_pem`.
pub fn trusting(ca_pem: Vec<u8>) -> TlsCertificates {
    TlsCertificates {
        client_tls: None,
        root_cert: Some(ca_pem),
    }
}

/// Certificates that trust only a CA that signed none of the servers.
pub fn another_ca() -> TlsCertificates {
    trusting(ca("some other CA").0.pem().into_bytes())
}
