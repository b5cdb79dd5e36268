//! What a failed connection's error says. tonic and etcd-client report "transport error" at the top of a
//! chain whose cause (a refused port, a rustls certificate error, a TLS alert from the peer) sits several
//! sources down, partly hidden inside `io::Error`s; this walks the chain, names the cause, and adds a hint
//! naming the flag to fix for the TLS failures people actually make.

use std::error::Error;
use std::io;

use rustls::{AlertDescription, CertificateError};

/// The kind of failure behind an error chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    /// The TLS handshake failed, or one side speaks TLS and the other does not.
    Tls,
    /// Nothing listens there (connection refused).
    Refused,
    /// No answer: timeout, no route, name resolution.
    Unreachable,
    /// The peer closed or reset an open connection. Right after a TLS 1.3 handshake this is usually a
    /// server refusing the client's certificate (or its absence) before the client read its alert.
    Closed,
    Other,
}

/// The cause, the chain's messages (joined with ": ") and, for TLS failures, a hint.
#[derive(Debug, Clone)]
pub struct Diagnosis {
    pub cause: Cause,
    pub detail: String,
    pub hint: Option<&'static str>,
}

impl std::fmt::Display for Diagnosis {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.detail)?;
        match self.hint {
            Some(h) => write!(f, " ({h})"),
            None => Ok(()),
        }
    }
}

/// The hint for a connection that TLS-configured side `client` saw closed ([`Cause::Closed`]).
pub const CLOSED_AFTER_HANDSHAKE: &str = "the server closed the connection after the TLS handshake: it likely refused this side's certificate, or its absence";

/// [`diagnose`], as one line for a log or an error message.
pub fn describe(err: &(dyn Error + 'static)) -> String {
    diagnose(err).to_string()
}

/// Walks `err` and its sources (and the errors `io::Error`s wrap, which `source()` skips).
pub fn diagnose(err: &(dyn Error + 'static)) -> Diagnosis {
    let mut detail = String::new();
    let mut cause = Cause::Other;
    let mut hint = None;
    let mut next: Option<&(dyn Error + 'static)> = Some(err);
    while let Some(e) = next {
        let text = e.to_string();
        if !detail.contains(&text) {
            if !detail.is_empty() {
                detail.push_str(": ");
            }
            detail.push_str(&text);
        }
        let mut inner = Some(e);
        if let Some(io) = e.downcast_ref::<io::Error>() {
            if cause == Cause::Other {
                cause = io_cause(io);
            }
            inner = io.get_ref().map(|i| i as &(dyn Error + 'static)).or(inner);
        }
        if let Some(r) = inner.and_then(|i| i.downcast_ref::<rustls::Error>()) {
            cause = Cause::Tls;
            hint = hint.or(rustls_hint(r));
        }
        next = e.source();
    }
    if cause != Cause::Tls && detail.contains("received fatal alert: ") {
        // HTTP/2 keeps an I/O error only as its kind and text (io::Error is not Clone): the rustls error
        // behind a TLS alert arrives as words.
        cause = Cause::Tls;
        hint = [
            ("CertificateRequired", AlertDescription::CertificateRequired),
            ("UnknownCA", AlertDescription::UnknownCA),
            ("BadCertificate", AlertDescription::BadCertificate),
            ("CertificateUnknown", AlertDescription::CertificateUnknown),
        ]
        .into_iter()
        .find(|(name, _)| detail.contains(&format!("received fatal alert: {name}")))
        .and_then(|(_, alert)| rustls_hint(&rustls::Error::AlertReceived(alert)));
    }
    if detail.contains(crate::server::PLAINTEXT_REFUSAL) {
        cause = Cause::Tls;
        hint = Some("the server requires TLS: this side has no --tls-ca, --tls-cert and --tls-key");
    } else if cause != Cause::Tls && (detail.contains("tls handshake eof") || detail.contains("TLS handshake timeout"))
    {
        cause = Cause::Tls;
        hint = Some("the server closed the connection during the TLS handshake: does it serve TLS?");
    } else if cause == Cause::Other && (detail.contains("timed out") || detail.contains("deadline has elapsed")) {
        cause = Cause::Unreachable;
    } else if cause == Cause::Other && (detail.contains("connection closed") || detail.contains("broken pipe")) {
        cause = Cause::Closed;
    }
    Diagnosis { cause, detail, hint }
}

fn io_cause(e: &io::Error) -> Cause {
    use io::ErrorKind::*;
    match e.kind() {
        ConnectionRefused => Cause::Refused,
        TimedOut | HostUnreachable | NetworkUnreachable | AddrNotAvailable => Cause::Unreachable,
        BrokenPipe | ConnectionReset | ConnectionAborted | UnexpectedEof => Cause::Closed,
        // getaddrinfo failures carry no kind of their own.
        _ if e.to_string().contains("lookup address") => Cause::Unreachable,
        _ => Cause::Other,
    }
}

fn rustls_hint(e: &rustls::Error) -> Option<&'static str> {
    use rustls::Error::*;
    Some(match e {
        InvalidCertificate(CertificateError::UnknownIssuer) => {
            "the peer's certificate is not signed by the CA this side trusts (--tls-ca, --etcd-ca)"
        }
        InvalidCertificate(CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. }) => {
            "the server's certificate does not carry the name or address dialed (the router's --tls-server-name sets the name to check)"
        }
        InvalidCertificate(CertificateError::Expired | CertificateError::ExpiredContext { .. }) => {
            "a certificate has expired"
        }
        InvalidCertificate(CertificateError::NotValidYet | CertificateError::NotValidYetContext { .. }) => {
            "a certificate is not valid yet (check the clocks)"
        }
        NoCertificatesPresented => "the client presented no certificate (--tls-cert, --tls-key)",
        AlertReceived(AlertDescription::CertificateRequired) => {
            "the server requires a client certificate: give this side --tls-cert and --tls-key (--etcd-cert, --etcd-key for etcd)"
        }
        AlertReceived(
            AlertDescription::UnknownCA | AlertDescription::BadCertificate | AlertDescription::CertificateUnknown,
        ) => "the peer refused this side's certificate: is it signed by the CA the peer trusts?",
        InvalidMessage(_) => "the peer does not speak TLS: is TLS off on its side?",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Wrap(&'static str, io::Error);
    impl std::fmt::Display for Wrap {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.0)
        }
    }
    impl Error for Wrap {
        fn source(&self) -> Option<&(dyn Error + 'static)> {
            Some(&self.1)
        }
    }

    #[test]
    fn a_rustls_error_inside_an_io_error_is_found_and_explained() {
        let tls = rustls::Error::InvalidCertificate(CertificateError::UnknownIssuer);
        let e = Wrap("transport error", io::Error::new(io::ErrorKind::InvalidData, tls));
        let d = diagnose(&e);
        assert_eq!(d.cause, Cause::Tls);
        assert!(d.detail.starts_with("transport error: invalid peer certificate"), "{}", d.detail);
        assert!(d.to_string().contains("--tls-ca"), "{d}");
    }

    #[test]
    fn an_alert_that_reached_us_only_as_text_is_still_explained() {
        let e = Wrap("transport error", io::Error::other("connection error: received fatal alert: UnknownCA"));
        let d = diagnose(&e);
        assert_eq!(d.cause, Cause::Tls);
        assert!(d.to_string().contains("refused this side's certificate"), "{d}");
        let e = Wrap("transport error", io::Error::other("received fatal alert: CertificateRequired"));
        assert!(diagnose(&e).to_string().contains("--tls-cert"), "{}", diagnose(&e));
    }

    #[test]
    fn refused_and_unreachable_are_told_apart() {
        let refused = Wrap("transport error", io::Error::from(io::ErrorKind::ConnectionRefused));
        assert_eq!(diagnose(&refused).cause, Cause::Refused);
        let timeout = Wrap("transport error", io::Error::from(io::ErrorKind::TimedOut));
        assert_eq!(diagnose(&timeout).cause, Cause::Unreachable);
        let other = Wrap("transport error", io::Error::other("boom"));
        assert_eq!(diagnose(&other).cause, Cause::Other);
        assert_eq!(diagnose(&other).detail, "transport error: boom");
    }
}
