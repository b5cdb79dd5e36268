//! Why an etcd request failed, in the words an operator needs: the credentials were refused, TLS failed,
//! or etcd could not be reached. etcd-client reports all three as a transport error or a gRPC status.

use tls::diagnose::Cause;

use crate::DiscoveryError;

/// Where requests go, for naming failures.
#[derive(Debug, Clone)]
pub(crate) struct Target {
    pub endpoints: String,
    /// TLS is on (`--etcd-ca`).
    pub tls: bool,
}

/// When the request failed: a connection closed at first contact means something else than one closed
/// after it worked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// The start-up check, on a fresh connection: etcd hanging up is a TLS disagreement (a plaintext
    /// client at a TLS port, or a client certificate etcd refuses, which TLS 1.3 reports only after the
    /// handshake).
    Start,
    /// Later: etcd going away (restart, crash, network) closes connections too.
    Running,
}

impl Target {
    /// Turns an etcd-client error into the [`DiscoveryError`] naming its cause.
    pub fn classify(&self, e: etcd_client::Error) -> DiscoveryError {
        self.classify_in(Phase::Running, e)
    }

    pub fn classify_in(&self, phase: Phase, e: etcd_client::Error) -> DiscoveryError {
        classify(&self.endpoints, Context { tls: self.tls, phase }, e)
    }
}

#[derive(Clone, Copy)]
struct Context {
    tls: bool,
    phase: Phase,
}

/// Whether `e` is a connection etcd closed (see [`Phase::Start`]).
pub(crate) fn is_closed(e: &etcd_client::Error) -> bool {
    let source: Option<&(dyn std::error::Error + 'static)> = match e {
        etcd_client::Error::GRpcStatus(s) => std::error::Error::source(s),
        etcd_client::Error::TransportError(t) => Some(t),
        etcd_client::Error::IoError(io) => Some(io),
        _ => None,
    };
    source.is_some_and(|s| tls::diagnose::diagnose(s).cause == Cause::Closed)
}

fn classify(endpoints: &str, cx: Context, e: etcd_client::Error) -> DiscoveryError {
    let endpoints = endpoints.to_owned();
    let cause = match &e {
        etcd_client::Error::GRpcStatus(s) => status_cause(s, cx),
        etcd_client::Error::TransportError(t) => transport_cause(t, cx),
        etcd_client::Error::IoError(io) => transport_cause(io, cx),
        _ => None,
    };
    match cause {
        Some((Kind::Auth, detail)) => DiscoveryError::EtcdAuth { endpoints, detail },
        Some((Kind::Tls, detail)) => DiscoveryError::EtcdTls { endpoints, detail },
        Some((Kind::Unreachable, detail)) => DiscoveryError::EtcdUnreachable { endpoints, detail },
        None => DiscoveryError::Etcd { endpoints, source: e },
    }
}

enum Kind {
    Auth,
    Tls,
    Unreachable,
}

fn transport_cause(e: &(dyn std::error::Error + 'static), cx: Context) -> Option<(Kind, String)> {
    let d = tls::diagnose::diagnose(e);
    let hint = match cx.tls {
        true => tls::diagnose::CLOSED_AFTER_HANDSHAKE,
        // A plaintext client's HTTP/2 preface is not a TLS handshake: a TLS-only etcd hangs up at once.
        false => "etcd hung up at once: does it serve TLS only? Then give --etcd-ca and use https://",
    };
    match (d.cause, cx.phase) {
        (Cause::Tls, _) => Some((Kind::Tls, d.to_string())),
        (Cause::Closed, Phase::Start) => Some((Kind::Tls, format!("{} ({hint})", d.detail))),
        (Cause::Closed, Phase::Running) => {
            Some((Kind::Unreachable, format!("connection lost: {} (if it keeps failing: {hint})", d.detail)))
        }
        (Cause::Refused | Cause::Unreachable, _) => Some((Kind::Unreachable, d.to_string())),
        (Cause::Other, _) => None,
    }
}

fn status_cause(s: &tonic::Status, cx: Context) -> Option<(Kind, String)> {
    use tonic::Code;
    let m = s.message();
    let auth = |hint: &str| Some((Kind::Auth, format!("{m} ({hint})")));
    // etcd's messages (api/v3rpc/rpctypes); some come as INVALID_ARGUMENT or FAILED_PRECONDITION.
    if m.contains("user name is empty") || (s.code() == Code::Unauthenticated && !m.contains("invalid auth token")) {
        return auth(
            "etcd requires authentication: give --etcd-user and a password (--etcd-password-file or TANDEM_ETCD_PASSWORD)",
        );
    }
    if m.contains("authentication failed") || m.contains("invalid user ID or password") {
        return auth("check --etcd-user and its password");
    }
    if m.contains("authentication is not enabled") {
        return auth("etcd has authentication off: drop --etcd-user or enable authentication in etcd");
    }
    if s.code() == Code::PermissionDenied || m.contains("permission denied") {
        return auth("the etcd user needs read and write access to the /tandem/<cluster>/ prefix");
    }
    if m.contains("invalid auth token") {
        return auth("the token expired and could not be renewed");
    }
    match std::error::Error::source(s) {
        Some(src) => transport_cause(src, cx),
        None if s.code() == Code::Unavailable => Some((Kind::Unreachable, m.to_owned())),
        None => None,
    }
}
