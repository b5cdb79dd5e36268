//! Ships a request's MLA latent and indexer caches from a prefill worker into the blocks a decode worker
//! reserved, over UCX, TCP or in-process.
//!
//! - Decode side ([`KvReceiver`]): serves the cache arena; per request [`KvReceiver::expect`] turns a
//!   `BlockPool` reservation into a [`TransferDescriptor`](proto::v1::TransferDescriptor) for the prefill
//!   worker, with a single-use [`TransferToken`], and a [`PendingTransfer`] that resolves to
//!   [`TransferOutcome::Completed`] (first token, logprobs, MTP draft; every layer and block verified),
//!   [`TransferOutcome::Released`] or a [`TransferError`]. Every write lands inside the reservation's blocks
//!   (receiver-placed), except in the opt-in one-sided UCX mode for trusted networks.
//! - Prefill side ([`KvSender`]): [`KvSender::begin`] validates the descriptor and handshakes before any
//!   byte moves; [`SendSession::put_layer`] queues a finished layer without blocking compute;
//!   [`SendSession::complete`], [`SendSession::release`] or [`SendSession::abort`] end it.
//! - [`transport`]: UCX (libucp loaded at run time, TCP fallback), TCP (tokio), in-process, one trait.
//! - [`layout`]: the put plan (runs contiguous on both sides go as single puts) and checksums.
//! - [`staging`]: a pool in GPU memory (`KvArena::from_device`) moves GPU to GPU where UCX is CUDA-capable
//!   (small and scattered layers gathered on the sender's GPU, several to a message, and scattered on the
//!   receiver's), else through bounded, reused host buffers, with
//!   the same protocol and guarantees; host pools move without a copy.
//!
//! See the crate README for the message sequence, failure semantics and the block-freeing policy.

pub mod error;
pub mod fault;
pub mod fingerprint;
pub mod layout;
pub mod receiver;
mod runtime;
pub mod sender;
pub mod staging;
#[doc(hidden)]
pub mod testkit;
pub mod token;
pub mod transport;
#[doc(hidden)]
pub mod wait;

use std::net::SocketAddr;
use std::sync::Arc;

pub use error::{RejectStatus, TransferError};
pub use fault::Fault;
pub use receiver::{
    CompletedTransfer, ExpectRequest, KvReceiver, PendingTransfer, ReceiverConfig, ReceiverStats, ReleasedTransfer,
    TransferOutcome,
};
pub use sender::{KvSender, SendReport, SendSession, SenderConfig};
pub use token::TransferToken;
pub use transport::TransportKind;

/// TCP transport settings.
#[derive(Debug, Clone)]
pub struct TcpConfig {
    /// Where the receiver listens (port 0 picks a free one).
    pub listen: SocketAddr,
    /// Host name or address put in descriptors (defaults to the listen address's IP).
    pub advertise_host: Option<String>,
}

impl Default for TcpConfig {
    fn default() -> Self {
        TcpConfig { listen: SocketAddr::from(([127, 0, 0, 1], 0)), advertise_host: None }
    }
}

/// Which transport a receiver serves (senders follow the descriptor).
#[derive(Debug, Clone)]
pub enum TransportConfig {
    /// UCX through libucp (`UCX_TLS` and the other `UCX_*` variables apply). When libucp cannot be
    /// loaded, falls back to TCP with `tcp_fallback` (or the default) and logs why.
    /// `tls` overrides `UCX_TLS` for this process's UCX context (tests pin tcp or shared memory).
    Ucx {
        tls: Option<String>,
        tcp_fallback: Option<TcpConfig>,
    },
    Tcp(TcpConfig),
    /// Same-process transfers (single-process mode, tests).
    InProc,
}

impl TransportConfig {
    /// The default configuration of `kind`.
    pub fn of_kind(kind: TransportKind) -> Self {
        match kind {
            TransportKind::Ucx => TransportConfig::Ucx { tls: None, tcp_fallback: None },
            TransportKind::Tcp => TransportConfig::Tcp(TcpConfig::default()),
            TransportKind::InProc => TransportConfig::InProc,
        }
    }
}

/// Whether libucp can be loaded on this machine (and why not).
pub fn ucx_available() -> Result<(), String> {
    transport::ucx::load().map(|_| ())
}

/// The transport `cfg` names; `one_sided_puts`: a UCX receiver accepts them, a UCX sender's `put` data
/// path uses them and `auto` may choose them (`put` without them is refused).
pub(crate) fn transport_for(
    cfg: &TransportConfig,
    rt: &Arc<runtime::Runtime>,
    lanes: Option<usize>,
    one_sided_puts: bool,
) -> Result<Arc<dyn transport::Transport>, TransferError> {
    Ok(match cfg {
        TransportConfig::InProc => Arc::new(transport::inproc::InProcTransport::new(rt.handle().clone())),
        TransportConfig::Tcp(c) => {
            Arc::new(transport::tcp::TcpTransport::with_lanes(c.clone(), rt.handle().clone(), lanes))
        }
        TransportConfig::Ucx { tls, tcp_fallback } => {
            // A configuration error stops here; only a missing libucp falls back to TCP.
            let dp = transport::ucx::DataPath::from_env().map_err(TransferError::Transport)?;
            transport::ucx::check_data_path(dp, one_sided_puts).map_err(TransferError::Transport)?;
            match transport::ucx::UcxTransport::with_options(tls.as_deref(), dp, lanes, one_sided_puts) {
                // Listen where the user asked: a loopback TCP address keeps UCX on loopback too.
                Ok(t) if tcp_fallback.as_ref().is_some_and(|c| c.listen.ip().is_loopback()) => {
                    Arc::new(t.loopback_only())
                }
                Ok(t) => Arc::new(t),
                Err(e) => {
                    tracing::warn!(reason = %e, "UCX unavailable, kv-transfer falls back to TCP");
                    Arc::new(transport::tcp::TcpTransport::with_lanes(
                        tcp_fallback.clone().unwrap_or_default(),
                        rt.handle().clone(),
                        lanes,
                    ))
                }
            }
        }
    })
}
