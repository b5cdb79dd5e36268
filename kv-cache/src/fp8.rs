//! FP8 e4m3 (`float8_e4m3fn`) conversion and the per-group quantization DeepSeek uses for activations,
//! the indexer keys and the MLA cache tiles (docs/model.md §2.1 and §4).

/// Largest finite e4m3fn value.
pub const E4M3_MAX: f32 = 448.0;

/// Smallest group amax considered, so an all-zero group still gets a finite scale.
pub const AMAX_FLOOR: f32 = 1e-4;

#[inline]
const fn decode_e4m3(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = ((b >> 3) & 0x0f) as i32;
    let man = (b & 0x07) as f32;
    if exp == 0x0f && (b & 0x07) == 0x07 {
        return f32::NAN;
    }
    let mag = if exp == 0 {
        // Subnormal: man/8 * 2^-6.
        man * (1.0 / 512.0)
    } else {
        let mut p = 1.0f32;
        let mut e = exp - 7;
        while e > 0 {
            p *= 2.0;
            e -= 1;
        }
        while e < 0 {
            p *= 0.5;
            e += 1;
        }
        (1.0 + man / 8.0) * p
    };
    sign * mag
}

#[inline]
const fn build_table() -> [f32; 256] {
    let mut t = [0.0f32; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = decode_e4m3(i as u8);
        i += 1;
    }
    t
}

/// Every e4m3fn byte's value.
pub static E4M3_TABLE: [f32; 256] = build_table();

#[inline]
pub fn e4m3_to_f32(b: u8) -> f32 {
    E4M3_TABLE[b as usize]
}

/// Round-to-nearest-even conversion to e4m3fn, saturating at +-448 (NaN maps to 0x7f).
#[inline]
pub fn f32_to_e4m3(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7f;
    }
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    let a = x.abs().min(E4M3_MAX);
    let code = if a < 1.0 / 64.0 {
        // Subnormal range (and the rounding up into the smallest normal): units of 2^-9.
        // `a * 512` is exact; round_ties_even gives RNE; codes 0..=8 are value/2^-9 (8 = 2^-6, exp 1).
        (a * 512.0).round_ties_even() as u8
    } else {
        let bits = a.to_bits();
        // Keep 3 mantissa bits with round-to-nearest-even on the 20 dropped bits.
        let lsb = (bits >> 20) & 1;
        let rounded = bits + 0x7ffff + lsb;
        let exp = ((rounded >> 23) as i32) - 127;
        let man = (rounded >> 20) & 0x7;
        (((exp + 7) as u32) << 3 | man) as u8
    };
    sign | code
}

/// Scale of a group whose largest magnitude is `amax`: `amax / 448`, rounded up to a power of two when
/// `ue8m0` (as DeepSeek's `act_quant` with `scale_fmt = ue8m0`: multiply by 1/448, then ceil of log2).
#[inline]
pub fn group_scale(amax: f32, ue8m0: bool) -> f32 {
    let s = amax.max(AMAX_FLOOR) * (1.0 / E4M3_MAX);
    if !ue8m0 {
        return s;
    }
    let bits = s.to_bits();
    let exp = ((bits >> 23) & 0xff) as i32;
    let man = bits & 0x7f_ffff;
    let e = exp - 127 + i32::from(man != 0);
    2f32.powi(e)
}

/// Quantizes one group: returns its scale and hands `emit(i, code)` the e4m3 code of `x[i] / scale`.
#[inline(always)]
fn quantize_with(x: &[f32], ue8m0: bool, mut emit: impl FnMut(usize, u8)) -> f32 {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let s = group_scale(amax, ue8m0);
    let inv = 1.0 / s;
    for (i, &v) in x.iter().enumerate() {
        // Power-of-two scales make `v * inv` exact; otherwise divide as the reference does.
        let q = if ue8m0 { v * inv } else { v / s };
        emit(i, f32_to_e4m3(q.clamp(-E4M3_MAX, E4M3_MAX)));
    }
    s
}

/// Quantizes one group: returns its scale and writes the e4m3 codes of `x / scale`.
#[inline]
pub fn quantize_group(x: &[f32], out: &mut [u8], ue8m0: bool) -> f32 {
    debug_assert_eq!(x.len(), out.len());
    quantize_with(x, ue8m0, |i, c| out[i] = c)
}

/// Quantizes one group and writes the decoded e4m3 values (not multiplied by the scale); returns the scale.
/// This is what an FP8 GEMM multiplies: `sum(qa * qw) * sa * sw`.
#[inline]
pub fn quantize_group_values(x: &[f32], out: &mut [f32], ue8m0: bool) -> f32 {
    debug_assert_eq!(x.len(), out.len());
    quantize_with(x, ue8m0, |i, c| out[i] = e4m3_to_f32(c))
}

/// `x` replaced by its quantized-then-dequantized value, group by group (what a consumer of the FP8 form sees).
#[inline]
pub fn fake_quantize(x: &mut [f32], group: usize, ue8m0: bool) {
    let mut tmp = vec![0.0f32; group];
    for g in x.chunks_mut(group) {
        let n = g.len();
        let s = quantize_group_values(g, &mut tmp[..n], ue8m0);
        for (v, q) in g.iter_mut().zip(&tmp[..n]) {
            *v = q * s;
        }
    }
}

/// bf16 rounding (round to nearest even), as stored in caches and checkpoints.
#[inline]
pub fn round_bf16(x: f32) -> f32 {
    half::bf16::from_f32(x).to_f32()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_matches_known_values() {
        assert_eq!(e4m3_to_f32(0x00), 0.0);
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(e4m3_to_f32(0xfe), -448.0);
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert_eq!(e4m3_to_f32(0x01), 1.0 / 512.0);
        assert_eq!(e4m3_to_f32(0x08), 1.0 / 64.0);
        assert!(e4m3_to_f32(0x7f).is_nan());
    }

    #[test]
    fn every_code_round_trips() {
        for b in 0..=255u8 {
            let v = e4m3_to_f32(b);
            if v.is_nan() {
                continue;
            }
            let back = f32_to_e4m3(v);
            // -0.0 and 0.0 both decode to zero.
            assert_eq!(e4m3_to_f32(back), v, "code {b:#x}");
        }
    }

    #[test]
    fn conversion_rounds_to_nearest_even_and_saturates() {
        // 1.0625 lies halfway between 1.0 (mantissa 0, even) and 1.125: ties to even.
        assert_eq!(e4m3_to_f32(f32_to_e4m3(1.0625)), 1.0);
        assert_eq!(e4m3_to_f32(f32_to_e4m3(1.1875)), 1.25);
        assert_eq!(e4m3_to_f32(f32_to_e4m3(1e6)), 448.0);
        assert_eq!(e4m3_to_f32(f32_to_e4m3(-1e6)), -448.0);
        // Halfway between two subnormals: 1.5 * 2^-9 -> 2 * 2^-9.
        assert_eq!(e4m3_to_f32(f32_to_e4m3(1.5 / 512.0)), 2.0 / 512.0);
        // Brute force against the nearest table value for many random magnitudes.
        let finite: Vec<f32> = (0..=0x7eu8).map(e4m3_to_f32).collect();
        let mut state = 0x1234_5678u32;
        for _ in 0..20000 {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            let x = (state as f32 / u32::MAX as f32) * 460.0;
            let got = e4m3_to_f32(f32_to_e4m3(x));
            let best =
                finite.iter().copied().fold(f32::INFINITY, |b, v| if (v - x).abs() < (b - x).abs() { v } else { b });
            assert!((got - x).abs() <= (best - x).abs(), "x={x} got={got} best={best}");
        }
    }

    #[test]
    fn ue8m0_scales_are_powers_of_two_covering_amax() {
        for amax in [1e-9f32, 1e-4, 0.3, 1.0, 447.0, 448.0, 449.0, 12345.0] {
            let s = group_scale(amax, true);
            assert_eq!(s.to_bits() & 0x7f_ffff, 0, "{s} not a power of two");
            assert!(amax.max(AMAX_FLOOR) / s <= E4M3_MAX * 1.0001, "amax {amax} scale {s}");
            assert!(amax.max(AMAX_FLOOR) / s > E4M3_MAX / 2.0 * 0.999, "scale {s} not tight for {amax}");
        }
    }
}
