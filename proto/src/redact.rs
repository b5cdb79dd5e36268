//! `Debug` for the messages that carry a kv-transfer token (the descriptor's transfer token, the
//! session token of an accepted handshake): every field but the token, which shows as `<redacted>`, so
//! logging a descriptor or a control message never leaks the secret. An Accept's regions show without
//! their memory key (UCX rkey) for the same reason. `build.rs` turns
//! the generated `Debug` of these messages off (the list is `redact_list.rs`).

use std::fmt;

use crate::v1::{
    MemoryRegion, TransferAbort, TransferAccept, TransferBegin, TransferComplete, TransferDescriptor, TransferRelease,
};

pub use self::list::TOKEN_CARRIERS;

#[path = "redact_list.rs"]
mod list;

/// What a token shows as.
struct Redacted;

impl fmt::Debug for Redacted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

impl fmt::Debug for TransferDescriptor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TransferDescriptor")
            .field("request_id", &self.request_id)
            .field("transfer_token", &Redacted)
            .field("deadline_unix_ms", &self.deadline_unix_ms)
            .field("fingerprint", &self.fingerprint)
            .field("endpoint", &self.endpoint)
            .field("layout", &self.layout)
            .field("block_ids", &self.block_ids)
            .field("num_tokens", &self.num_tokens)
            .field("verify_checksum", &self.verify_checksum)
            .finish()
    }
}

impl fmt::Debug for TransferBegin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TransferBegin")
            .field("request_id", &self.request_id)
            .field("transfer_token", &Redacted)
            .field("num_tokens", &self.num_tokens)
            .field("block_ids", &self.block_ids)
            .field("layout", &self.layout)
            .field("fingerprint", &self.fingerprint)
            .field("sender_address", &self.sender_address)
            .field("receiver_mediated", &self.receiver_mediated)
            .finish()
    }
}

/// The regions of an Accept: where they are and how long, never their memory key (in the one-sided mode a
/// write capability for the whole pool).
struct Regions<'a>(&'a [MemoryRegion]);

impl fmt::Debug for Regions<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list()
            .entries(self.0.iter().map(|r| {
                format!("MemoryRegion {{ remote_addr: {:#x}, length: {}, rkey: <redacted> }}", r.remote_addr, r.length)
            }))
            .finish()
    }
}

impl fmt::Debug for TransferAccept {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TransferAccept")
            .field("session_id", &self.session_id)
            .field("regions", &Regions(&self.regions))
            .field("max_write", &self.max_write)
            .field("session_token", &Redacted)
            .finish()
    }
}

impl fmt::Debug for TransferComplete {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TransferComplete")
            .field("session_id", &self.session_id)
            .field("session_token", &Redacted)
            .field("first_token", &self.first_token)
            .field("draft", &self.draft)
            .field("layers", &self.layers)
            .finish()
    }
}

impl fmt::Debug for TransferRelease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TransferRelease")
            .field("session_id", &self.session_id)
            .field("session_token", &Redacted)
            .field("first_token", &self.first_token)
            .field("finish_reason", &self.finish_reason)
            .finish()
    }
}

impl fmt::Debug for TransferAbort {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TransferAbort")
            .field("session_id", &self.session_id)
            .field("session_token", &Redacted)
            .field("reason", &self.reason)
            .field("status", &self.status)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v1::transfer_control::Body;
    use crate::v1::{PrefillRequest, TransferControl};

    #[test]
    fn debug_output_never_shows_the_token() {
        let token = vec![0xa5; 16];
        let shown = |s: String| {
            assert!(s.contains("<redacted>"), "{s}");
            assert!(!s.contains("165"), "the token's bytes leaked: {s}");
        };
        let desc = TransferDescriptor { request_id: "r".into(), transfer_token: token.clone(), ..Default::default() };
        shown(format!("{desc:?}"));
        shown(format!("{:?}", PrefillRequest { transfer: Some(desc), ..Default::default() }));
        let bodies = [
            Body::Begin(TransferBegin { transfer_token: token.clone(), ..Default::default() }),
            Body::Accept(TransferAccept { session_token: token.clone(), ..Default::default() }),
            Body::Complete(TransferComplete { session_token: token.clone(), ..Default::default() }),
            Body::Release(TransferRelease { session_token: token.clone(), ..Default::default() }),
            Body::Abort(TransferAbort { session_token: token.clone(), ..Default::default() }),
        ];
        for b in bodies {
            shown(format!("{:?}", TransferControl { correlation_id: 1, body: Some(b) }));
        }
    }

    #[test]
    fn debug_output_never_shows_an_accepts_memory_key() {
        let region = MemoryRegion { remote_addr: 0x1000, length: 4096, rkey: vec![0xa5; 32] };
        let accept = TransferAccept { regions: vec![region], ..Default::default() };
        let s = format!("{accept:?}");
        assert!(s.contains("remote_addr: 0x1000, length: 4096, rkey: <redacted>"), "{s}");
        assert!(!s.contains("165"), "the key's bytes leaked: {s}");
    }
}
