//! Typed errors of both sides. Each wire status (`TransferStatus`) maps to one variant, so a rejection on
//! the receiver surfaces as the same error on the sender.

use proto::FingerprintMismatch;
use proto::v1::TransferStatus;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransferError {
    /// The descriptor or handshake is malformed or does not match this side (checked before any write).
    #[error("bad descriptor for request {request_id}: {reason}")]
    BadDescriptor { request_id: String, reason: String },
    #[error("model fingerprint mismatch: {0}")]
    FingerprintMismatch(String),
    /// The receiver refused the handshake or a later message.
    #[error("receiver rejected request {request_id}: {status:?}: {message}")]
    Rejected { request_id: String, status: RejectStatus, message: String },
    #[error("request {0}: transfer deadline exceeded")]
    DeadlineExceeded(String),
    /// Aborted by the decode worker (client gone) or by the sender (prefill failed).
    #[error("request {request_id}: transfer aborted: {reason}")]
    Aborted { request_id: String, reason: String },
    /// The other process or its connection went away mid-transfer.
    #[error("request {request_id}: peer lost: {reason}")]
    PeerLost { request_id: String, reason: String },
    /// Completion arrived but not every layer and block was written, or a checksum differs.
    #[error("request {request_id}: bad completion: {reason}")]
    BadCompletion { request_id: String, reason: String },
    /// The caller used the API out of order (a layer twice, completion before every layer, ...).
    #[error("request {request_id}: {reason}")]
    Usage { request_id: String, reason: String },
    #[error("transport: {0}")]
    Transport(String),
    #[error("request {0} already has a pending transfer")]
    Duplicate(String),
}

/// Why a receiver refused: the wire status without the OK value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RejectStatus {
    UnknownRequest,
    BadToken,
    FingerprintMismatch,
    LayoutMismatch,
    BadBlocks,
    BadSize,
    DeadlineExceeded,
    Aborted,
    Incomplete,
    ChecksumMismatch,
    AlreadyStarted,
    Protocol,
}

impl From<FingerprintMismatch> for TransferError {
    fn from(e: FingerprintMismatch) -> Self {
        TransferError::FingerprintMismatch(e.to_string())
    }
}

impl RejectStatus {
    pub fn from_wire(s: TransferStatus) -> Option<Self> {
        Some(match s {
            TransferStatus::Ok => return None,
            TransferStatus::UnknownRequest => Self::UnknownRequest,
            TransferStatus::BadToken => Self::BadToken,
            TransferStatus::FingerprintMismatch => Self::FingerprintMismatch,
            TransferStatus::LayoutMismatch => Self::LayoutMismatch,
            TransferStatus::BadBlocks => Self::BadBlocks,
            TransferStatus::BadSize => Self::BadSize,
            TransferStatus::DeadlineExceeded => Self::DeadlineExceeded,
            TransferStatus::Aborted => Self::Aborted,
            TransferStatus::Incomplete => Self::Incomplete,
            TransferStatus::ChecksumMismatch => Self::ChecksumMismatch,
            TransferStatus::AlreadyStarted => Self::AlreadyStarted,
            TransferStatus::Protocol => Self::Protocol,
        })
    }

    pub fn to_wire(self) -> TransferStatus {
        match self {
            Self::UnknownRequest => TransferStatus::UnknownRequest,
            Self::BadToken => TransferStatus::BadToken,
            Self::FingerprintMismatch => TransferStatus::FingerprintMismatch,
            Self::LayoutMismatch => TransferStatus::LayoutMismatch,
            Self::BadBlocks => TransferStatus::BadBlocks,
            Self::BadSize => TransferStatus::BadSize,
            Self::DeadlineExceeded => TransferStatus::DeadlineExceeded,
            Self::Aborted => TransferStatus::Aborted,
            Self::Incomplete => TransferStatus::Incomplete,
            Self::ChecksumMismatch => TransferStatus::ChecksumMismatch,
            Self::AlreadyStarted => TransferStatus::AlreadyStarted,
            Self::Protocol => TransferStatus::Protocol,
        }
    }
}

impl TransferError {
    pub(crate) fn rejected(request_id: &str, status: TransferStatus, message: impl Into<String>) -> Self {
        let message = message.into();
        match RejectStatus::from_wire(status) {
            Some(RejectStatus::DeadlineExceeded) => TransferError::DeadlineExceeded(request_id.to_string()),
            Some(RejectStatus::Aborted) => {
                TransferError::Aborted { request_id: request_id.to_string(), reason: message }
            }
            Some(status) => TransferError::Rejected { request_id: request_id.to_string(), status, message },
            None => TransferError::Transport(format!("request {request_id}: OK status where an error was expected")),
        }
    }

    /// The wire status that reports this error to the other side.
    pub(crate) fn wire_status(&self) -> TransferStatus {
        match self {
            TransferError::BadDescriptor { .. } | TransferError::Usage { .. } => TransferStatus::Protocol,
            TransferError::FingerprintMismatch(_) => TransferStatus::FingerprintMismatch,
            TransferError::Rejected { status, .. } => status.to_wire(),
            TransferError::DeadlineExceeded(_) => TransferStatus::DeadlineExceeded,
            TransferError::Aborted { .. } | TransferError::PeerLost { .. } => TransferStatus::Aborted,
            TransferError::BadCompletion { .. } => TransferStatus::Incomplete,
            TransferError::Transport(_) => TransferStatus::Protocol,
            TransferError::Duplicate(_) => TransferStatus::AlreadyStarted,
        }
    }
}
