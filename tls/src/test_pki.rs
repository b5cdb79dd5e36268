//! A throwaway public-key infrastructure for tests: a CA and certificates it signs, written as PEM files
//! to a temporary directory that lives as long as the [`TestPki`].

use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, Certificate, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose,
    SanType,
};

/// A CA and its files.
pub struct TestPki {
    dir: tempfile::TempDir,
    name: String,
    ca_cert: Certificate,
    ca_key: KeyPair,
}

/// One certificate's files.
#[derive(Debug, Clone)]
pub struct Leaf {
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl TestPki {
    /// A new CA named `name`; its certificate is [`TestPki::ca`].
    pub fn new(name: &str) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
        params.distinguished_name.push(DnType::CommonName, format!("{name} test CA"));
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let key = KeyPair::generate().expect("CA key");
        let cert = params.self_signed(&key).expect("CA certificate");
        std::fs::write(dir.path().join("ca.crt"), cert.pem()).expect("write CA");
        Self { dir, name: name.to_owned(), ca_cert: cert, ca_key: key }
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The CA certificate (PEM).
    pub fn ca(&self) -> PathBuf {
        self.dir.path().join("ca.crt")
    }

    /// A certificate for servers and clients alike (both extended key usages), valid for `localhost`,
    /// 127.0.0.1 and the given DNS names, with `common_name` as its CN (etcd takes it as the user name of
    /// a client certificate).
    pub fn leaf(&self, common_name: &str, dns: &[&str]) -> Leaf {
        let mut names: Vec<String> = vec!["localhost".into()];
        names.extend(dns.iter().map(|d| d.to_string()));
        let mut params = CertificateParams::new(names).expect("params");
        params.subject_alt_names.push(SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST)));
        params.distinguished_name.push(DnType::CommonName, common_name);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
        let key = KeyPair::generate().expect("leaf key");
        let cert = params.signed_by(&key, &self.ca_cert, &self.ca_key).expect("leaf certificate");
        let stem = format!("{}-{common_name}", self.name);
        let leaf = Leaf {
            cert: self.dir.path().join(format!("{stem}.crt")),
            key: self.dir.path().join(format!("{stem}.key")),
        };
        std::fs::write(&leaf.cert, cert.pem()).expect("write certificate");
        std::fs::write(&leaf.key, key.serialize_pem()).expect("write key");
        leaf
    }
}
