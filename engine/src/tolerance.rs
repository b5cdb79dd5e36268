//! How results are compared (docs/model.md §6): the whole-tensor `diff` every accuracy bound is stated in.

/// `1 - 2 sum(ab) / sum(a^2 + b^2)`, summed in f64: 0 for equal tensors, about 1 for unrelated ones.
pub fn diff(a: &[f32], b: &[f32]) -> f64 {
    let (mut ab, mut aa) = (0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        ab += *x as f64 * *y as f64;
        aa += (*x as f64).powi(2) + (*y as f64).powi(2);
    }
    1.0 - 2.0 * ab / aa
}
