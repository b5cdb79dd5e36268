//! Reading the PEM files behind the TLS flags. Every error names the flag and the file and says what is
//! wrong with it; none quotes the file (a key must never reach a log through an error message).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::RootCertStore;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::sign::CertifiedKey;

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{flag} {}: cannot read it: {cause}", path.display())]
    Read { flag: &'static str, path: PathBuf, cause: std::io::Error },
    #[error("{flag} {}: {what}", path.display())]
    Invalid { flag: &'static str, path: PathBuf, what: String },
    #[error(
        "{key_flag} {} is not the key of the certificate in {cert_flag} {} (their public keys differ)",
        key.display(),
        cert.display()
    )]
    KeyMismatch { cert_flag: &'static str, cert: PathBuf, key_flag: &'static str, key: PathBuf },
    /// Flags given in a combination that cannot work; the message names them.
    #[error("{0}")]
    Flags(String),
}

/// The files of one TLS identity or trust anchor, with the flags that named them (for messages).
#[derive(Debug, Clone, Copy)]
pub struct Flagged<'a> {
    pub flag: &'static str,
    pub path: &'a Path,
}

fn invalid(f: Flagged<'_>, what: impl Into<String>) -> TlsError {
    TlsError::Invalid { flag: f.flag, path: f.path.to_owned(), what: what.into() }
}

/// The file's bytes.
pub fn read(f: Flagged<'_>) -> Result<Vec<u8>, TlsError> {
    std::fs::read(f.path).map_err(|cause| TlsError::Read { flag: f.flag, path: f.path.to_owned(), cause })
}

/// Every certificate in a PEM file (a chain: leaf first), at least one.
pub fn certificates(f: Flagged<'_>, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| invalid(f, "not a readable PEM file (a certificate block is damaged)"))?;
    if certs.is_empty() {
        return Err(invalid(f, "no PEM certificate in it (expected -----BEGIN CERTIFICATE-----)"));
    }
    Ok(certs)
}

/// The private key in a PEM file (PKCS#8, PKCS#1 or SEC1).
pub fn private_key(f: Flagged<'_>, pem: &[u8]) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_slice(pem).map_err(|e| match e {
        rustls::pki_types::pem::Error::NoItemsFound => invalid(
            f,
            "no PEM private key in it (expected -----BEGIN PRIVATE KEY-----, RSA PRIVATE KEY or EC PRIVATE KEY)",
        ),
        _ => invalid(f, "not a readable PEM private key"),
    })
}

/// The CA file as a trust store: every certificate in it must parse as a trust anchor.
pub fn roots(f: Flagged<'_>) -> Result<RootCertStore, TlsError> {
    let pem = read(f)?;
    let mut store = RootCertStore::empty();
    for cert in certificates(f, &pem)? {
        store.add(cert).map_err(|e| invalid(f, format!("not a usable CA certificate: {e}")))?;
    }
    Ok(store)
}

/// A certificate chain and its private key, checked to belong together.
pub fn certified_key(cert: Flagged<'_>, key: Flagged<'_>) -> Result<Arc<CertifiedKey>, TlsError> {
    let chain = certificates(cert, &read(cert)?)?;
    let der = private_key(key, &read(key)?)?;
    let provider = crate::provider();
    let signing = provider
        .key_provider
        .load_private_key(der)
        .map_err(|e| invalid(key, format!("not a usable private key: {e}")))?;
    let certified = CertifiedKey::new(chain, signing);
    match certified.keys_match() {
        Ok(()) | Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::Unknown)) => Ok(Arc::new(certified)),
        Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::KeyMismatch)) => Err(TlsError::KeyMismatch {
            cert_flag: cert.flag,
            cert: cert.path.to_owned(),
            key_flag: key.flag,
            key: key.path.to_owned(),
        }),
        Err(e) => Err(invalid(cert, format!("not a usable certificate: {e}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flagged<'a>(flag: &'static str, path: &'a Path) -> Flagged<'a> {
        Flagged { flag, path }
    }

    fn identity(dir: &Path, name: &str) -> (PathBuf, PathBuf) {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["localhost".into()]).unwrap().self_signed(&key).unwrap();
        let (c, k) = (dir.join(format!("{name}.crt")), dir.join(format!("{name}.key")));
        std::fs::write(&c, cert.pem()).unwrap();
        std::fs::write(&k, key.serialize_pem()).unwrap();
        (c, k)
    }

    #[test]
    fn a_matching_pair_loads_and_a_foreign_key_is_named_as_the_mismatch() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = identity(dir.path(), "a");
        let (_, other_key) = identity(dir.path(), "b");
        assert!(certified_key(flagged("--tls-cert", &cert), flagged("--tls-key", &key)).is_ok());
        let err = certified_key(flagged("--tls-cert", &cert), flagged("--tls-key", &other_key)).unwrap_err();
        assert!(matches!(err, TlsError::KeyMismatch { .. }), "{err}");
        let msg = err.to_string();
        assert!(msg.contains("--tls-key") && msg.contains("b.key") && msg.contains("a.crt"), "{msg}");
    }

    #[test]
    fn unreadable_and_wrong_files_name_the_flag_the_file_and_the_cause() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = identity(dir.path(), "a");
        let missing = dir.path().join("nope.pem");
        let err = roots(flagged("--tls-ca", &missing)).unwrap_err().to_string();
        assert!(err.starts_with("--tls-ca ") && err.contains("nope.pem") && err.contains("cannot read"), "{err}");

        // A key where the certificate belongs, and a certificate where the key belongs.
        let err = certified_key(flagged("--tls-cert", &key), flagged("--tls-key", &key)).unwrap_err().to_string();
        assert!(err.contains("--tls-cert") && err.contains("no PEM certificate"), "{err}");
        let err = certified_key(flagged("--tls-cert", &cert), flagged("--tls-key", &cert)).unwrap_err().to_string();
        assert!(err.contains("--tls-key") && err.contains("no PEM private key"), "{err}");

        let garbage = dir.path().join("garbage.pem");
        std::fs::write(&garbage, "-----BEGIN CERTIFICATE-----\n!!!!\n-----END CERTIFICATE-----\n").unwrap();
        let err = roots(flagged("--tls-ca", &garbage)).unwrap_err().to_string();
        assert!(err.contains("--tls-ca") && err.contains("damaged"), "{err}");
    }

    #[test]
    fn errors_about_a_key_file_never_quote_it() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = identity(dir.path(), "a");
        let pem = std::fs::read_to_string(&key).unwrap();
        let body: String = pem.lines().nth(1).unwrap().to_owned();
        // A damaged key: its base64 body is cut in half.
        let damaged = dir.path().join("damaged.key");
        std::fs::write(&damaged, pem.replace(&body, &body[..body.len() / 2])).unwrap();
        for err in [
            certified_key(flagged("--tls-cert", &cert), flagged("--tls-key", &damaged)).unwrap_err(),
            certified_key(flagged("--tls-cert", &key), flagged("--tls-key", &key)).unwrap_err(),
        ] {
            let (msg, dbg) = (err.to_string(), format!("{err:?}"));
            assert!(!msg.contains(&body[..16]) && !dbg.contains(&body[..16]), "{msg} / {dbg}");
        }
    }
}
