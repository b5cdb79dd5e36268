//! UCX transport (placeholder while the libucp module lands).

use std::sync::Arc;
use std::time::Instant;

use engine::cache::KvCache;
use proto::v1::TransportEndpoint;

use super::{Inbound, Link, Served, Transport, TransportKind};
use crate::TransferError;
use crate::receiver::core::ReceiverCore;

pub fn load() -> Result<(), String> {
    Err("not yet".into())
}

pub struct UcxTransport;

impl UcxTransport {
    pub fn new(_tls: Option<&str>) -> Result<Self, String> {
        load().map(|_| UcxTransport)
    }
}

impl Transport for UcxTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Ucx
    }
    fn serve(&self, _core: Arc<ReceiverCore>) -> Result<Served, TransferError> {
        Err(TransferError::Transport("ucx".into()))
    }
    fn connect(
        &self,
        _e: &TransportEndpoint,
        _l: &Arc<KvCache>,
        _i: Arc<dyn Inbound>,
        _d: Instant,
    ) -> Result<Arc<dyn Link>, TransferError> {
        Err(TransferError::Transport("ucx".into()))
    }
}
