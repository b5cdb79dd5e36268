//! The secrets of a transfer. The *transfer token* is the one a prefill worker proves it was handed the
//! descriptor with: made when the decode worker reserves blocks
//! ([`KvReceiver::expect`](crate::KvReceiver::expect)), carried by the descriptor, required in the
//! handshake, which it opens exactly once. The *session token* goes only to the sender whose handshake
//! was accepted (in its `Accept`) and authenticates the session's later messages and every write, so a
//! copy of a used descriptor opens nothing. Both die with the transfer.
//!
//! 16 bytes from the operating system's random number generator (not a user-space generator seeded from
//! it), compared in constant time, never printed: `Debug` shows `<redacted>`, and the protobuf messages
//! that carry it redact it too (`proto::redact`). A token's bytes are wiped when it is dropped.

use rand::TryRng;

use crate::TransferError;

/// Bytes in a transfer token on the wire.
pub const TOKEN_BYTES: usize = 16;

/// A reservation's secret. No `PartialEq`: compare with [`TransferToken::matches`] (constant time).
#[derive(Clone)]
pub struct TransferToken([u8; TOKEN_BYTES]);

impl TransferToken {
    /// A fresh token from the OS random number generator (`getrandom`); fails only when the OS cannot
    /// give entropy, and then nothing is reserved on its strength.
    pub fn generate() -> Result<Self, TransferError> {
        let mut b = [0u8; TOKEN_BYTES];
        rand::rngs::SysRng
            .try_fill_bytes(&mut b)
            .map_err(|e| TransferError::Transport(format!("the OS random number generator failed: {e}")))?;
        Ok(TransferToken(b))
    }

    /// The token of a wire field; `None` unless it has exactly [`TOKEN_BYTES`] bytes.
    pub fn from_wire(bytes: &[u8]) -> Option<Self> {
        bytes.try_into().ok().map(TransferToken)
    }

    /// Whether `presented` is this token, in time independent of where they differ (only a wrong length,
    /// which is public, returns early).
    pub fn matches(&self, presented: &[u8]) -> bool {
        let Ok(p) = <&[u8; TOKEN_BYTES]>::try_from(presented) else { return false };
        let diff = self.0.iter().zip(p).fold(0u8, |acc, (a, b)| acc | (a ^ b));
        std::hint::black_box(diff) == 0
    }

    /// The token's bytes, for the wire.
    pub fn as_bytes(&self) -> &[u8; TOKEN_BYTES] {
        &self.0
    }

    pub fn to_vec(&self) -> Vec<u8> {
        self.0.to_vec()
    }
}

/// Wipes the bytes when the token goes (volatile writes the compiler cannot drop as dead stores), so a
/// finished transfer's secret does not linger in freed memory. Copies made for the wire (`to_vec`, the
/// protobuf messages, socket buffers) are not covered.
impl Drop for TransferToken {
    fn drop(&mut self) {
        for b in &mut self.0 {
            // SAFETY: a valid, exclusive reference to one of our bytes.
            unsafe { std::ptr::write_volatile(b, 0) };
        }
        std::sync::atomic::compiler_fence(std::sync::atomic::Ordering::SeqCst);
    }
}

impl std::fmt::Debug for TransferToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TransferToken(<redacted>)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_fresh_and_match_only_their_own_bytes() {
        let a = TransferToken::generate().unwrap();
        let b = TransferToken::generate().unwrap();
        assert_ne!(a.as_bytes(), b.as_bytes(), "two 128-bit draws collided");
        assert!(a.matches(a.as_bytes()));
        assert!(!a.matches(b.as_bytes()));
        let mut flipped = *a.as_bytes();
        flipped[TOKEN_BYTES - 1] ^= 1;
        assert!(!a.matches(&flipped));
        assert!(!a.matches(&[]), "a missing token");
        assert!(!a.matches(&a.as_bytes()[..8]), "a truncated token");
        let mut longer = a.to_vec();
        longer.push(0);
        assert!(!a.matches(&longer), "a token with a trailing byte");
        assert!(TransferToken::from_wire(&longer).is_none());
        assert!(TransferToken::from_wire(a.as_bytes()).unwrap().matches(a.as_bytes()));
    }

    #[test]
    fn dropping_a_token_wipes_its_bytes() {
        let mut t = std::mem::ManuallyDrop::new(TransferToken::from_wire(&[0xa5; TOKEN_BYTES]).unwrap());
        let at: *const [u8; TOKEN_BYTES] = &t.0;
        // SAFETY: dropped once; the storage stays ours (ManuallyDrop), and the bytes are plain data.
        let after = unsafe {
            std::mem::ManuallyDrop::drop(&mut t);
            std::ptr::read_volatile(at)
        };
        assert_eq!(after, [0; TOKEN_BYTES]);
    }

    #[test]
    fn debug_never_shows_the_bytes() {
        let t = TransferToken::from_wire(&[0xa5; TOKEN_BYTES]).unwrap();
        let s = format!("{t:?}");
        assert_eq!(s, "TransferToken(<redacted>)");
    }
}
