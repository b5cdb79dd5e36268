//! The router's side of a TLS link to a worker: tonic's client config built from checked files.

use std::time::Duration;

use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

use crate::pem::{Flagged, TlsError};

/// Longest TLS handshake the router waits for.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Verifies workers against the CA and presents the router's certificate, when it has one.
#[derive(Clone)]
pub struct ClientTls {
    // tonic's config derives Debug over the key's PEM: never print it.
    config: ClientTlsConfig,
    server_name: Option<String>,
    presents_certificate: bool,
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientTls")
            .field("server_name", &self.server_name)
            .field("presents_certificate", &self.presents_certificate)
            .finish_non_exhaustive()
    }
}

impl ClientTls {
    pub(crate) fn load(
        ca: Flagged<'_>,
        pair: Option<(Flagged<'_>, Flagged<'_>)>,
        server_name: Option<&str>,
    ) -> Result<Self, TlsError> {
        // Checked here, with messages naming the files: tonic itself skips what it cannot parse.
        crate::pem::roots(ca)?;
        let mut config = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(crate::pem::read(ca)?))
            .timeout(HANDSHAKE_TIMEOUT);
        if let Some((cert, key)) = pair {
            crate::pem::certified_key(cert, key)?;
            config = config.identity(Identity::from_pem(crate::pem::read(cert)?, crate::pem::read(key)?));
        }
        if let Some(name) = server_name {
            config = config.domain_name(name);
        }
        Ok(Self { config, server_name: server_name.map(str::to_owned), presents_certificate: pair.is_some() })
    }

    /// The URI to dial `address` ("host:port", or a URL) over TLS: `https://host:port`.
    pub fn uri(address: &str) -> String {
        let hostport = address.strip_prefix("http://").or_else(|| address.strip_prefix("https://")).unwrap_or(address);
        format!("https://{hostport}")
    }

    /// Puts TLS on an endpoint made from [`ClientTls::uri`].
    pub fn apply(&self, endpoint: Endpoint) -> Result<Endpoint, tonic::transport::Error> {
        endpoint.tls_config(self.config.clone())
    }

    /// The name worker certificates are checked against, when it is not the dialed host.
    pub fn server_name(&self) -> Option<&str> {
        self.server_name.as_deref()
    }

    /// Whether the router presents a certificate (workers that require one refuse it otherwise).
    pub fn presents_certificate(&self) -> bool {
        self.presents_certificate
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_dialed_over_https() {
        assert_eq!(ClientTls::uri("10.0.0.1:8100"), "https://10.0.0.1:8100");
        assert_eq!(ClientTls::uri("http://w:1"), "https://w:1");
        assert_eq!(ClientTls::uri("https://w:1"), "https://w:1");
    }
}
