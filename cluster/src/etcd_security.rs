//! TLS to etcd and etcd credentials: what the flags name ([`EtcdSecurity`], paths and a user name only),
//! and what is read from those files when the client is built. The password lives in a [`Password`],
//! which prints as `<redacted>`, and goes nowhere but etcd's Authenticate call.

use std::path::PathBuf;

use etcd_client::{Certificate, Identity, TlsOptions as ClientTlsConfig};
use tls::pem::Flagged;

use crate::DiscoveryError;

/// The environment variable that may carry the etcd password (the alternative to a password file).
pub const PASSWORD_ENV: &str = "TANDEM_ETCD_PASSWORD";

/// Where the etcd password comes from. Only the source is kept here, never the password.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PasswordSource {
    File(PathBuf),
    /// An environment variable, by name.
    Env(String),
}

/// How to reach a secured etcd. The default is plaintext without credentials.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EtcdSecurity {
    /// CA (PEM) that signed etcd's server certificate; TLS to etcd when set.
    pub ca: Option<PathBuf>,
    /// Client certificate and key (PEM), for an etcd started with --client-cert-auth.
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    /// etcd user (etcd with authentication enabled), and where its password is.
    pub user: Option<String>,
    pub password: Option<PasswordSource>,
}

/// An etcd password. Never printed: `Debug` shows `<redacted>` and there is no `Display`.
#[derive(Clone)]
pub struct Password(String);

impl std::fmt::Debug for Password {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

/// A user and password for etcd's Authenticate call.
#[derive(Debug, Clone)]
pub(crate) struct Credentials {
    pub user: String,
    password: Password,
}

impl Credentials {
    /// The pair etcd-client's `update_user` takes.
    pub fn pair(&self) -> (String, String) {
        (self.user.clone(), self.password.0.clone())
    }
}

/// What [`EtcdSecurity::load`] read: tonic's TLS config (which must never be printed: its `Debug` shows
/// the key) and the credentials.
pub(crate) struct Loaded {
    pub tls: Option<ClientTlsConfig>,
    pub credentials: Option<Credentials>,
}

fn config(msg: String) -> DiscoveryError {
    DiscoveryError::Config(msg)
}

impl EtcdSecurity {
    /// Checks the flag combinations and the endpoints' schemes against them. Messages name the flags.
    pub fn check(&self, endpoints: &[String]) -> Result<(), DiscoveryError> {
        match (&self.cert, &self.key) {
            (Some(_), None) => return Err(config("--etcd-cert needs --etcd-key".into())),
            (None, Some(_)) => return Err(config("--etcd-key needs --etcd-cert".into())),
            (Some(_), Some(_)) if self.ca.is_none() => {
                return Err(config(
                    "--etcd-cert/--etcd-key need --etcd-ca (the CA that signed etcd's certificate)".into(),
                ));
            }
            _ => {}
        }
        for e in endpoints {
            if self.ca.is_some() && e.starts_with("http://") {
                return Err(config(format!("--etcd {e:?}: with --etcd-ca, etcd is reached over TLS: use https://")));
            }
            if self.ca.is_none() && e.starts_with("https://") {
                return Err(config(format!(
                    "--etcd {e:?}: https needs --etcd-ca (the CA that signed etcd's certificate)"
                )));
            }
        }
        match (&self.user, &self.password) {
            (Some(u), _) if u.is_empty() => Err(config("--etcd-user must not be empty".into())),
            (Some(_), None) => Err(config(format!(
                "--etcd-user needs a password: --etcd-password-file FILE or the {PASSWORD_ENV} environment variable"
            ))),
            (None, Some(_)) => Err(config("an etcd password was given without --etcd-user".into())),
            _ => Ok(()),
        }
    }

    /// Whether anything here is set.
    pub fn is_set(&self) -> bool {
        *self != Self::default()
    }

    /// Reads and checks the files and the password (start-up and `--check-config`).
    pub(crate) fn load(&self, endpoints: &[String]) -> Result<Loaded, DiscoveryError> {
        self.check(endpoints)?;
        let tls_error = |e: tls::TlsError| config(e.to_string());
        let tls = match &self.ca {
            None => None,
            Some(ca) => {
                let ca = Flagged { flag: "--etcd-ca", path: ca };
                tls::pem::roots(ca).map_err(tls_error)?;
                let mut c = ClientTlsConfig::new()
                    .ca_certificate(Certificate::from_pem(tls::pem::read(ca).map_err(tls_error)?));
                if let (Some(cert), Some(key)) = (&self.cert, &self.key) {
                    let (cert, key) =
                        (Flagged { flag: "--etcd-cert", path: cert }, Flagged { flag: "--etcd-key", path: key });
                    tls::pem::certified_key(cert, key).map_err(tls_error)?;
                    c = c.identity(Identity::from_pem(
                        tls::pem::read(cert).map_err(tls_error)?,
                        tls::pem::read(key).map_err(tls_error)?,
                    ));
                }
                Some(c)
            }
        };
        let credentials = match (&self.user, &self.password) {
            (Some(user), Some(source)) => Some(Credentials { user: user.clone(), password: read_password(source)? }),
            _ => None,
        };
        Ok(Loaded { tls, credentials })
    }
}

fn read_password(source: &PasswordSource) -> Result<Password, DiscoveryError> {
    let (raw, from) = match source {
        PasswordSource::File(p) => (
            std::fs::read_to_string(p)
                .map_err(|e| config(format!("--etcd-password-file {}: cannot read it: {e}", p.display())))?,
            format!("--etcd-password-file {}", p.display()),
        ),
        PasswordSource::Env(var) => {
            (std::env::var(var).map_err(|e| config(format!("{var}: {e}")))?, format!("the {var} environment variable"))
        }
    };
    // Files written with `echo` or by an editor end with a newline that is not part of the password.
    let password = raw.strip_suffix('\n').map(|p| p.strip_suffix('\r').unwrap_or(p)).unwrap_or(&raw);
    if password.is_empty() {
        return Err(config(format!("the etcd password from {from} is empty")));
    }
    Ok(Password(password.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_password_is_read_without_its_final_newline_and_never_printed() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("pw");
        std::fs::write(&file, "s3cr3t-pw\n").unwrap();
        let sec = EtcdSecurity {
            user: Some("tandem".into()),
            password: Some(PasswordSource::File(file.clone())),
            ..Default::default()
        };
        let loaded = sec.load(&["http://e:2379".into()]).unwrap();
        let creds = loaded.credentials.unwrap();
        assert_eq!(creds.pair(), ("tandem".to_string(), "s3cr3t-pw".to_string()));
        let printed = format!("{creds:?} {sec:?}");
        assert!(!printed.contains("s3cr3t") && printed.contains("<redacted>"), "{printed}");

        std::fs::write(&file, "\r\n").unwrap();
        let err = sec.load(&[]).err().unwrap().to_string();
        assert!(err.contains("empty") && err.contains("--etcd-password-file"), "{err}");
    }

    #[test]
    fn incomplete_or_contradicting_flags_are_named() {
        let check = |s: EtcdSecurity, e: &str| s.check(&[e.to_string()]).err().map(|e| e.to_string());
        let ca = || Some(PathBuf::from("ca.pem"));
        let err = check(EtcdSecurity { ca: ca(), ..Default::default() }, "http://e:2379").unwrap();
        assert!(err.contains("use https://"), "{err}");
        let err = check(EtcdSecurity::default(), "https://e:2379").unwrap();
        assert!(err.contains("needs --etcd-ca"), "{err}");
        assert!(check(EtcdSecurity { ca: ca(), ..Default::default() }, "e:2379").is_none(), "bare host:port");
        let err = check(EtcdSecurity { cert: ca(), ..Default::default() }, "e:2379").unwrap();
        assert!(err.contains("--etcd-key"), "{err}");
        let err = check(EtcdSecurity { user: Some("u".into()), ..Default::default() }, "e:2379").unwrap();
        assert!(err.contains("--etcd-password-file") && err.contains(PASSWORD_ENV), "{err}");
        let pw = Some(PasswordSource::Env("X".into()));
        let err = check(EtcdSecurity { password: pw, ..Default::default() }, "e:2379").unwrap();
        assert!(err.contains("--etcd-user"), "{err}");
    }
}
