//! Optional mutual TLS on tandem's internal gRPC links (the router dialing prefill and decode workers), and
//! the PEM checks the etcd client shares. Plaintext stays the default: nothing here runs without a flag.
//!
//! - [`TlsArgs`]: `--tls-ca`, `--tls-cert`, `--tls-key` on the router and both workers (`TANDEM_TLS_*`).
//! - [`ServerTls`] (workers): serves the certificate; with a CA it requires and verifies client
//!   certificates. [`incoming`] runs the handshakes, logs why one failed, and answers a plaintext client
//!   that the port requires TLS instead of dropping it silently.
//! - [`ClientTls`] (router): verifies workers against the CA, under `--tls-server-name` when the
//!   certificates do not carry the workers' addresses, and presents the router's certificate.
//! - [`pem`]: reading and checking CA, certificate and key files. Errors name the flag, the file and the
//!   cause, never the contents; no type here prints key material in its `Debug`.
//! - [`diagnose`]: what a failed connection's error chain says (TLS, refused, unreachable), with a hint
//!   naming the flag to fix.
//! - `test_pki` (feature `test-pki`): a throwaway CA and certificates for tests.

mod args;
mod client;
pub mod diagnose;
pub mod pem;
mod server;
#[cfg(feature = "test-pki")]
pub mod test_pki;

pub use args::TlsArgs;
pub use client::ClientTls;
pub use pem::TlsError;
pub use server::{ServerTls, incoming};

/// The one crypto provider every config here uses (ring), so that no process-wide default is needed.
pub(crate) fn provider() -> std::sync::Arc<rustls::crypto::CryptoProvider> {
    std::sync::Arc::new(rustls::crypto::ring::default_provider())
}
