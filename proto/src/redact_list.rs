//! The messages whose generated `Debug` is replaced by one that leaves the transfer or session token out
//! (`src/redact.rs`); read by `build.rs` too, so the two lists cannot drift apart.

pub const TOKEN_CARRIERS: [&str; 6] =
    ["TransferDescriptor", "TransferBegin", "TransferAccept", "TransferComplete", "TransferRelease", "TransferAbort"];
