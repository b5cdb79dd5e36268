//! The transfer checksum: a 64-bit digest of a byte stream that a GPU computes in parallel and the host
//! computes in one pass, with the same value.
//!
//! kv-transfer hashes each layer's bytes on both sides (the pieces of a layer concatenated in plan order).
//! A streaming hash such as xxh3 chains every 1 KiB block to the previous one, so a GPU could only hash a
//! layer sequentially. This one is a sum: the stream is read as little-endian 64-bit words `w_j` (the last
//! one zero-padded), each word is mixed with its position, and the terms are added modulo 2^64, which any
//! number of threads can do in any order and still agree bit for bit:
//!
//! ```text
//! x_j    = w_j ^ key(j)                  key(j) = (j + 1) * P1 ^ P2
//! t_j    = lo32(x_j) * hi32(x_j) + rotl(w_j, 29)
//! digest = avalanche(sum_j t_j  ^  avalanche(len + P3))
//! ```
//!
//! The product is xxh3's accumulator step; the rotated word keeps a word whose mixed halves multiply to
//! zero from vanishing, and `key(j)` makes the sum depend on where each word sits (moved or swapped blocks
//! change it). It detects what transfers get wrong (lost, duplicated, misplaced, zeroed or flipped bytes);
//! like xxh3 it is not a defence against a peer who forges data. The GPU side is
//! `engine/kernels/kv_transfer.cu`; both sides are held to [`digest`] by tests.

/// xxh3's PRIME64 constants.
const P1: u64 = 0x9E37_79B1_85EB_CA87;
const P2: u64 = 0xC2B2_AE3D_27D4_EB4F;
const P3: u64 = 0x1656_67B1_9E37_79F9;

/// The position key of word `j`.
#[inline]
pub fn key(j: u64) -> u64 {
    j.wrapping_add(1).wrapping_mul(P1) ^ P2
}

/// Word `j`'s term of the sum.
#[inline]
pub fn term(w: u64, j: u64) -> u64 {
    let x = w ^ key(j);
    (x & 0xffff_ffff).wrapping_mul(x >> 32).wrapping_add(w.rotate_left(29))
}

/// xxh3's final mix.
#[inline]
fn avalanche(mut h: u64) -> u64 {
    h ^= h >> 37;
    h = h.wrapping_mul(0x1656_6791_9E37_79F9);
    h ^ (h >> 32)
}

/// The digest of a stream of `len` bytes whose terms add up to `sum` (what a GPU reduction returns).
#[inline]
pub fn finish(sum: u64, len: u64) -> u64 {
    avalanche(sum ^ avalanche(len.wrapping_add(P3)))
}

/// The digest of `bytes`.
pub fn digest(bytes: &[u8]) -> u64 {
    let mut h = Sum64::new();
    h.update(bytes);
    h.digest()
}

/// The streaming form: `update` with the stream's pieces in order (cut anywhere), then `digest`.
#[derive(Debug, Clone, Default)]
pub struct Sum64 {
    sum: u64,
    len: u64,
    /// Bytes of the word being filled (`len % 8` of them are valid).
    partial: [u8; 8],
}

impl Sum64 {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn update(&mut self, mut bytes: &[u8]) {
        let fill = (self.len % 8) as usize;
        if fill != 0 {
            let n = (8 - fill).min(bytes.len());
            self.partial[fill..fill + n].copy_from_slice(&bytes[..n]);
            self.len += n as u64;
            bytes = &bytes[n..];
            if !self.len.is_multiple_of(8) {
                return;
            }
            self.sum = self.sum.wrapping_add(term(u64::from_le_bytes(self.partial), self.len / 8 - 1));
        }
        let mut words = bytes.chunks_exact(8);
        let mut sum = self.sum;
        for (j, w) in (self.len / 8..).zip(&mut words) {
            sum = sum.wrapping_add(term(u64::from_le_bytes(w.try_into().expect("8 bytes")), j));
        }
        self.sum = sum;
        let rest = words.remainder();
        self.len += (bytes.len() - rest.len()) as u64;
        if !rest.is_empty() {
            self.partial = [0; 8];
            self.partial[..rest.len()].copy_from_slice(rest);
            self.len += rest.len() as u64;
        }
    }

    pub fn digest(&self) -> u64 {
        let mut sum = self.sum;
        let fill = (self.len % 8) as usize;
        if fill != 0 {
            let mut last = [0u8; 8];
            last[..fill].copy_from_slice(&self.partial[..fill]);
            sum = sum.wrapping_add(term(u64::from_le_bytes(last), self.len / 8));
        }
        finish(sum, self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(n: usize, seed: u64) -> Vec<u8> {
        let mut s = seed | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                s as u8
            })
            .collect()
    }

    #[test]
    fn any_cut_of_the_stream_gives_the_same_digest() {
        let b = bytes(1000, 3);
        let want = digest(&b);
        for cuts in [vec![0, 1000], vec![0, 1, 2, 3, 1000], vec![0, 7, 15, 16, 17, 999, 1000], vec![0, 500, 501, 1000]]
        {
            let mut h = Sum64::new();
            for w in cuts.windows(2) {
                h.update(&b[w[0]..w[1]]);
            }
            assert_eq!(h.digest(), want, "cuts {cuts:?}");
        }
    }

    #[test]
    fn the_sum_is_order_free_and_matches_the_formula() {
        // What a GPU does: terms in any order, then finish.
        let b = bytes(8 * 100 + 5, 9);
        let mut sum = 0u64;
        for j in (0..101u64).rev() {
            let mut w = [0u8; 8];
            let s = &b[(8 * j as usize)..(8 * j as usize + 8).min(b.len())];
            w[..s.len()].copy_from_slice(s);
            sum = sum.wrapping_add(term(u64::from_le_bytes(w), j));
        }
        assert_eq!(finish(sum, b.len() as u64), digest(&b));
    }

    #[test]
    fn transfer_errors_change_the_digest() {
        let b = bytes(8448 * 4, 5);
        let want = digest(&b);
        // A flipped bit anywhere.
        for i in [0, 1, 7, 8, 4095, 8448 * 4 - 1] {
            for bit in [0, 3, 7] {
                let mut c = b.clone();
                c[i] ^= 1 << bit;
                assert_ne!(digest(&c), want, "byte {i} bit {bit}");
            }
        }
        // Two blocks swapped, one block duplicated over another, a block zeroed, a byte more or less.
        let (x, y) = (0..8448, 8448 * 2..8448 * 3);
        let mut swapped = b.clone();
        swapped[x.clone()].copy_from_slice(&b[y.clone()]);
        swapped[y.clone()].copy_from_slice(&b[x.clone()]);
        assert_ne!(digest(&swapped), want);
        let mut dup = b.clone();
        dup[y.clone()].copy_from_slice(&b[x.clone()]);
        assert_ne!(digest(&dup), want);
        let mut zeroed = b.clone();
        zeroed[y].fill(0);
        assert_ne!(digest(&zeroed), want);
        assert_ne!(digest(&b[..b.len() - 1]), want);
        let mut longer = b.clone();
        longer.push(0);
        assert_ne!(digest(&longer), want, "a trailing zero byte changes the length");
        assert_ne!(digest(&[]), digest(&[0]));
        assert_ne!(digest(&[0; 8]), digest(&[0; 16]));
    }

    #[test]
    fn known_values_pin_the_definition() {
        // The GPU kernel's tests compare against `digest`; these pin `digest` itself, so a change to the
        // definition (which both sides of a transfer must share) is a visible, deliberate one.
        assert_eq!(digest(&[]), finish(0, 0));
        let b: Vec<u8> = (0..20u8).collect();
        let w0 = u64::from_le_bytes(b[0..8].try_into().unwrap());
        let w1 = u64::from_le_bytes(b[8..16].try_into().unwrap());
        let w2 = u64::from_le_bytes([16, 17, 18, 19, 0, 0, 0, 0]);
        let sum = term(w0, 0).wrapping_add(term(w1, 1)).wrapping_add(term(w2, 2));
        assert_eq!(digest(&b), finish(sum, 20));
        assert_eq!(digest(&b), 0x8c25_100e_2e1b_7d27);
    }
}
