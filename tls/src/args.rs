//! The TLS flags every role flattens into its command line. The same three files serve both ends: a worker
//! serves its certificate and checks clients against the CA; the router checks workers against the CA and
//! presents its certificate.

use std::path::PathBuf;

use crate::pem::{Flagged, TlsError};
use crate::{ClientTls, ServerTls};

/// `--tls-ca`, `--tls-cert`, `--tls-key`. With none of them the links stay plaintext.
#[derive(clap::Args, Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsArgs {
    /// CA certificate (PEM) of the router <-> worker gRPC links: a worker given it requires a client
    /// certificate signed by it (mutual TLS); the router verifies workers against it. Plaintext when no
    /// --tls-* flag is given.
    #[arg(long = "tls-ca", env = "TANDEM_TLS_CA", value_name = "PEM")]
    pub ca: Option<PathBuf>,
    /// This process's certificate chain (PEM, leaf first): a worker serves it, the router presents it to
    /// workers. Needs --tls-key.
    #[arg(long = "tls-cert", env = "TANDEM_TLS_CERT", value_name = "PEM")]
    pub cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM: PKCS#8, PKCS#1 or SEC1).
    #[arg(long = "tls-key", env = "TANDEM_TLS_KEY", value_name = "PEM")]
    pub key: Option<PathBuf>,
}

impl TlsArgs {
    /// Whether any TLS flag is given.
    pub fn is_set(&self) -> bool {
        self.ca.is_some() || self.cert.is_some() || self.key.is_some()
    }

    /// The certificate and key, both or neither.
    fn pair(&self) -> Result<Option<(Flagged<'_>, Flagged<'_>)>, TlsError> {
        match (&self.cert, &self.key) {
            (Some(c), Some(k)) => {
                Ok(Some((Flagged { flag: "--tls-cert", path: c }, Flagged { flag: "--tls-key", path: k })))
            }
            (None, None) => Ok(None),
            (Some(_), None) => {
                Err(TlsError::Flags("--tls-cert needs --tls-key (the certificate's private key)".into()))
            }
            (None, Some(_)) => {
                Err(TlsError::Flags("--tls-key needs --tls-cert (the certificate it belongs to)".into()))
            }
        }
    }

    fn ca(&self) -> Option<Flagged<'_>> {
        self.ca.as_deref().map(|path| Flagged { flag: "--tls-ca", path })
    }

    /// A worker's server side, files read and checked: `None` without flags; with `--tls-ca`, clients must
    /// present a certificate signed by it.
    pub fn server(&self) -> Result<Option<ServerTls>, TlsError> {
        let Some((cert, key)) = self.pair()? else {
            return match self.ca {
                Some(_) => Err(TlsError::Flags(
                    "--tls-ca on a worker needs --tls-cert and --tls-key (the certificate it serves)".into(),
                )),
                None => Ok(None),
            };
        };
        let identity = crate::pem::certified_key(cert, key)?;
        let client_roots = self.ca().map(crate::pem::roots).transpose()?;
        ServerTls::new(identity, client_roots).map(Some)
    }

    /// The router's client side, files read and checked: `None` without flags. Workers are verified
    /// against `--tls-ca` under `server_name` (default: the host the router dials).
    pub fn client(&self, server_name: Option<&str>) -> Result<Option<ClientTls>, TlsError> {
        let pair = self.pair()?;
        let Some(ca) = self.ca() else {
            return match (pair, server_name) {
                (None, None) => Ok(None),
                (Some(_), _) => Err(TlsError::Flags(
                    "--tls-cert/--tls-key on the router need --tls-ca (the CA that signed the workers' certificates)"
                        .into(),
                )),
                (None, Some(_)) => Err(TlsError::Flags("--tls-server-name needs --tls-ca".into())),
            };
        };
        if let Some(name) = server_name {
            rustls::pki_types::ServerName::try_from(name)
                .map_err(|_| TlsError::Flags(format!("--tls-server-name {name:?}: not a DNS name or IP address")))?;
        }
        ClientTls::load(ca, pair, server_name).map(Some)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        tls: TlsArgs,
    }

    fn parse(a: &[&str]) -> TlsArgs {
        Cli::try_parse_from(std::iter::once("x").chain(a.iter().copied())).unwrap().tls
    }

    #[test]
    fn no_flags_is_plaintext_on_both_sides() {
        let a = parse(&[]);
        assert!(!a.is_set());
        assert!(a.server().unwrap().is_none());
        assert!(a.client(None).unwrap().is_none());
    }

    #[test]
    fn incomplete_combinations_are_refused_by_flag_name() {
        let err = |r: Result<(), TlsError>| r.unwrap_err().to_string();
        let server = |a: &[&str]| parse(a).server().map(|_| ());
        let client = |a: &[&str], name| parse(a).client(name).map(|_| ());
        assert!(err(server(&["--tls-cert", "c"])).contains("--tls-key"));
        assert!(err(server(&["--tls-key", "k"])).contains("--tls-cert"));
        assert!(err(server(&["--tls-ca", "ca"])).contains("needs --tls-cert and --tls-key"));
        assert!(err(client(&["--tls-cert", "c", "--tls-key", "k"], None)).contains("need --tls-ca"));
        assert!(err(client(&[], Some("w"))).contains("--tls-server-name needs --tls-ca"));
    }
}
