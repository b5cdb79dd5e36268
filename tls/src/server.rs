//! A worker's side of a TLS link: the rustls server config and the accept loop that feeds tonic.
//!
//! tonic can run the handshakes itself, but it logs their failures at debug level only, and a plaintext
//! client sees nothing but a closed connection. Here a failed handshake is a warning naming the peer and
//! the reason, and a plaintext HTTP/2 client gets a GOAWAY saying that the port requires TLS.

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rustls::RootCertStore;
use rustls::server::WebPkiClientVerifier;
use rustls::sign::CertifiedKey;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tokio_stream::wrappers::ReceiverStream;
use tracing::{debug, warn};

use crate::pem::TlsError;

/// Longest wait for a client's first byte and then for its handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// A misconfigured client retries every health poll: one warning per client address this often.
const WARN_EVERY: Duration = Duration::from_secs(60);
/// What a plaintext client is told (HTTP/2 GOAWAY debug data, or an HTTP/1 body).
pub const PLAINTEXT_REFUSAL: &str = "this tandem port requires TLS: give the client --tls-ca, --tls-cert and --tls-key";

/// The server config: the worker's certificate, and client verification when a CA was given.
#[derive(Clone)]
pub struct ServerTls {
    config: Arc<rustls::ServerConfig>,
    mutual: bool,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls").field("mutual", &self.mutual).finish_non_exhaustive()
    }
}

impl ServerTls {
    pub(crate) fn new(identity: Arc<CertifiedKey>, client_roots: Option<RootCertStore>) -> Result<Self, TlsError> {
        let builder = rustls::ServerConfig::builder_with_provider(crate::provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Flags(format!("TLS setup: {e}")))?;
        let mutual = client_roots.is_some();
        let builder = match client_roots {
            Some(roots) => {
                let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), crate::provider())
                    .build()
                    .map_err(|e| TlsError::Flags(format!("--tls-ca: cannot verify clients with it: {e}")))?;
                builder.with_client_cert_verifier(verifier)
            }
            None => builder.with_no_client_auth(),
        };
        let mut config = builder.with_cert_resolver(Arc::new(rustls::sign::SingleCertAndKey::from(identity)));
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Self { config: Arc::new(config), mutual })
    }

    /// Whether clients must present a certificate signed by `--tls-ca`.
    pub fn requires_client_certificates(&self) -> bool {
        self.mutual
    }
}

/// The connections of `listener` that complete a TLS handshake, for tonic's `serve_with_incoming*`. The
/// accept loop ends when the stream is dropped.
pub fn incoming(listener: TcpListener, tls: ServerTls) -> ReceiverStream<io::Result<TlsStream<TcpStream>>> {
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(accept_loop(listener, tls, tx));
    ReceiverStream::new(rx)
}

async fn accept_loop(listener: TcpListener, tls: ServerTls, tx: mpsc::Sender<io::Result<TlsStream<TcpStream>>>) {
    let acceptor = TlsAcceptor::from(tls.config.clone());
    let throttle = Arc::new(Throttle::default());
    loop {
        let (stream, peer) = tokio::select! {
            _ = tx.closed() => return,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors and the like: wait instead of spinning.
                    warn!(error = %e, "accepting a gRPC connection failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let (acceptor, tx, throttle, mutual) = (acceptor.clone(), tx.clone(), throttle.clone(), tls.mutual);
        tokio::spawn(async move {
            if let Some(s) = handshake(stream, peer, acceptor, &throttle, mutual).await {
                let _ = tx.send(Ok(s)).await;
            }
        });
    }
}

async fn handshake(
    stream: TcpStream,
    peer: SocketAddr,
    acceptor: TlsAcceptor,
    throttle: &Throttle,
    mutual: bool,
) -> Option<TlsStream<TcpStream>> {
    let mut first = [0u8; 1];
    match tokio::time::timeout(HANDSHAKE_TIMEOUT, stream.peek(&mut first)).await {
        // A TCP probe (Kubernetes tcpSocket, a port scan): connected, sent nothing, left.
        Ok(Ok(0)) => {
            debug!(%peer, "connection closed before any byte");
            return None;
        }
        // Every TLS connection starts with a handshake record (content type 22).
        Ok(Ok(_)) if first[0] != 0x16 => {
            let level_warn = throttle.first_in_a_while(peer.ip());
            if level_warn {
                warn!(%peer, "plaintext connection refused: this port requires TLS (the client needs --tls-ca, --tls-cert and --tls-key)");
            } else {
                debug!(%peer, "plaintext connection refused");
            }
            refuse_plaintext(stream, first[0]).await;
            return None;
        }
        Ok(Ok(_)) => {}
        Ok(Err(e)) => {
            debug!(%peer, error = %e, "connection failed before the TLS handshake");
            return None;
        }
        Err(_) => {
            debug!(%peer, "no TLS handshake within {HANDSHAKE_TIMEOUT:?}");
            return None;
        }
    }
    let (failure, stream) = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream).into_fallible()).await
    {
        Ok(Ok(s)) => return Some(s),
        Ok(Err((e, stream))) => (crate::diagnose::describe(&e), Some(stream)),
        Err(_) => (format!("no complete handshake within {HANDSHAKE_TIMEOUT:?}"), None),
    };
    if throttle.first_in_a_while(peer.ip()) {
        let hint = if mutual { " (clients need a certificate signed by this worker's --tls-ca)" } else { "" };
        warn!(%peer, reason = %failure, "TLS handshake failed{hint}");
    } else {
        debug!(%peer, reason = %failure, "TLS handshake failed");
    }
    // rustls wrote its alert (e.g. "certificate required"). A TLS 1.3 client sends its first requests
    // right after its certificate: closing with those unread would reset the connection, and the client
    // would see "connection reset" instead of the alert.
    if let Some(stream) = stream {
        close_gently(stream).await;
    }
    None
}

/// Reads an HTTP/2 client's connection preface and frames until its first HEADERS frame (a request).
async fn first_h2_request(stream: &mut TcpStream) -> io::Result<()> {
    const PREFACE: usize = 24;
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    let mut at = PREFACE;
    loop {
        while buf.len() >= at + 9 {
            let len = u32::from_be_bytes([0, buf[at], buf[at + 1], buf[at + 2]]) as usize;
            if buf[at + 3] == 0x1 {
                return Ok(());
            }
            at += 9 + len;
        }
        let n = stream.read(&mut chunk).await?;
        if n == 0 || buf.len() > 64 << 10 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// Reads what the client still sends until it hangs up, having read our answer (at most two seconds), then
/// closes. Closing at once would race the answer: an end of stream overtakes a GOAWAY in the client's
/// HTTP/2 state machine, and unread data makes the kernel reset the connection.
async fn close_gently(mut stream: TcpStream) {
    let mut sink = [0u8; 4096];
    let _ = tokio::time::timeout(Duration::from_secs(2), async {
        while matches!(stream.read(&mut sink).await, Ok(n) if n > 0) {}
    })
    .await;
    let _ = stream.shutdown().await;
}

/// Tells a plaintext client why it is refused, in its own protocol where that is cheap: a GOAWAY
/// (INADEQUATE_SECURITY) after the server's SETTINGS for HTTP/2, a 400 for HTTP/1.
async fn refuse_plaintext(mut stream: TcpStream, first: u8) {
    let reply = if first == b'P' {
        // Answer once the client's first request is on the wire: a GOAWAY that arrives before the client
        // has handed its request to HTTP/2 only cancels it ("connection closed"), without the reason.
        let _ = tokio::time::timeout(Duration::from_secs(1), first_h2_request(&mut stream)).await;
        // HTTP/2 frames: 9-byte header (24-bit length, type, flags, 31-bit stream id), then the payload.
        let debug = PLAINTEXT_REFUSAL.as_bytes();
        let mut frames = vec![0, 0, 0, 0x4, 0, 0, 0, 0, 0]; // SETTINGS, empty
        let len = (8 + debug.len()) as u32;
        frames.extend_from_slice(&len.to_be_bytes()[1..]);
        frames.extend_from_slice(&[0x7, 0, 0, 0, 0, 0]); // GOAWAY on stream 0
        frames.extend_from_slice(&0u32.to_be_bytes()); // last stream id: none was processed
        frames.extend_from_slice(&0xcu32.to_be_bytes()); // INADEQUATE_SECURITY
        frames.extend_from_slice(debug);
        frames
    } else if first.is_ascii_uppercase() {
        format!(
            "HTTP/1.1 400 Bad Request\r\ncontent-type: text/plain\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{PLAINTEXT_REFUSAL}\n",
            PLAINTEXT_REFUSAL.len() + 1
        )
        .into_bytes()
    } else {
        Vec::new()
    };
    let _ = stream.write_all(&reply).await;
    close_gently(stream).await;
}

/// One warning per client address per [`WARN_EVERY`].
#[derive(Default)]
struct Throttle {
    last: Mutex<HashMap<IpAddr, Instant>>,
}

impl Throttle {
    fn first_in_a_while(&self, ip: IpAddr) -> bool {
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        if last.len() > 4096 {
            last.retain(|_, t| now.duration_since(*t) < WARN_EVERY);
        }
        match last.get(&ip) {
            Some(t) if now.duration_since(*t) < WARN_EVERY => false,
            _ => {
                last.insert(ip, now);
                true
            }
        }
    }
}
