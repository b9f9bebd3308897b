//! Dense building blocks on the CPU: quantized matrix products (on the packed 4/8-bit data, one row dequantized
//! at a time, never a whole matrix), RMSNorm, activations.

use rayon::prelude::*;

use crate::config::GROUP_SIZE;
use crate::quant::{group_sums, QView};

/// Largest input width a matrix may have (bounds the stack buffer of group sums).
const MAX_COLS: usize = 16384;

/// A raw output pointer shared by threads that write disjoint elements.
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

/// `out[t][r] = sum_c w[r][c] * x[t][c]` for `t` in `0..x.len() / w.cols`.
pub fn qmatmul(w: QView, x: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2, the only feature `qmatmul_avx2` is compiled for.
        return unsafe { qmatmul_avx2(w, x, out) };
    }
    qmatmul_portable(w, x, out)
}

/// The same code compiled for AVX2: the 4-bit unpacking (a word's 8 nibbles against 8 inputs) becomes one
/// 8-lane shift, mask, convert and multiply-add.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn qmatmul_avx2(w: QView, x: &[f32], out: &mut [f32]) {
    qmatmul_portable(w, x, out)
}

#[inline(always)]
fn qmatmul_portable(w: QView, x: &[f32], out: &mut [f32]) {
    let (rows, cols) = (w.rows, w.cols);
    assert!(cols <= MAX_COLS && x.len().is_multiple_of(cols));
    let tokens = x.len() / cols;
    assert_eq!(out.len(), tokens * rows);
    let groups = cols / GROUP_SIZE;
    if tokens == 1 {
        let mut sums = [0.0f32; MAX_COLS / GROUP_SIZE];
        group_sums(x, &mut sums[..groups]);
        let sums = &sums[..groups];
        out.par_iter_mut()
            .enumerate()
            .with_min_len(16)
            .for_each(|(r, o)| *o = w.dot_row(r, x, sums));
        return;
    }
    const BLOCK: usize = 8;
    let out_ptr = SharedOut(out.as_mut_ptr());
    (0..rows.div_ceil(BLOCK)).into_par_iter().for_each(|block| {
        // Rebinding moves the whole wrapper (which is Send) into the closure rather than its raw pointer field.
        #[allow(clippy::redundant_locals)]
        let out_ptr = out_ptr;
        let mut row = vec![0.0f32; cols];
        for r in block * BLOCK..((block + 1) * BLOCK).min(rows) {
            w.dequantize_row(r, &mut row);
            for t in 0..tokens {
                let v = dot(&row, &x[t * cols..(t + 1) * cols]);
                // SAFETY: each (t, r) is written by exactly one task; `out` outlives the parallel loop.
                unsafe { *out_ptr.0.add(t * rows + r) = v };
            }
        }
    });
}

#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let chunks = a.len() / 8;
    for i in 0..chunks {
        for j in 0..8 {
            acc[j] += a[i * 8 + j] * b[i * 8 + j];
        }
    }
    let mut total: f32 = acc.iter().sum();
    for i in chunks * 8..a.len() {
        total += a[i] * b[i];
    }
    total
}

/// Zero-centred RMSNorm with the scale stored as `1 + w`, applied to each `scale.len()`-wide row of `x`.
pub fn rmsnorm(x: &[f32], scale: &[f32], eps: f32, out: &mut [f32]) {
    let n = scale.len();
    for (xr, or) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
        let mean_sq = xr.iter().map(|v| v * v).sum::<f32>() / n as f32;
        let inv = 1.0 / (mean_sq + eps).sqrt();
        for i in 0..n {
            or[i] = xr[i] * inv * scale[i];
        }
    }
}

pub fn rmsnorm_in_place(x: &mut [f32], scale: &[f32], eps: f32) {
    let n = scale.len();
    for xr in x.chunks_exact_mut(n) {
        let mean_sq = xr.iter().map(|v| v * v).sum::<f32>() / n as f32;
        let inv = 1.0 / (mean_sq + eps).sqrt();
        for i in 0..n {
            xr[i] *= inv * scale[i];
        }
    }
}

#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

#[inline]
pub fn softplus(x: f32) -> f32 {
    // torch's softplus switches to the identity above 20.
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::QMatrix;
    use crate::rng::Rng;

    #[test]
    fn qmatmul_matches_dequantized_reference_for_one_and_many_tokens() {
        let mut rng = Rng::new(3);
        for bits in [4, 8] {
            let (rows, cols) = (37, 256);
            let w: Vec<f32> = (0..rows * cols).map(|_| rng.normal()).collect();
            let m = QMatrix::quantize(&w, rows, cols, bits);
            for tokens in [1, 5] {
                let x: Vec<f32> = (0..tokens * cols).map(|_| rng.normal()).collect();
                let mut out = vec![f32::NAN; tokens * rows];
                qmatmul(m.view(), &x, &mut out);
                let mut row = vec![0.0; cols];
                for r in 0..rows {
                    m.view().dequantize_row(r, &mut row);
                    for t in 0..tokens {
                        let reference: f64 = (0..cols).map(|c| row[c] as f64 * x[t * cols + c] as f64).sum();
                        let got = out[t * rows + r] as f64;
                        assert!(
                            (got - reference).abs() <= 1e-4 * (1.0 + reference.abs()),
                            "{got} {reference}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn rmsnorm_normalises() {
        let x = [3.0f32, 4.0];
        let mut out = [0.0; 2];
        rmsnorm(&x, &[1.0, 2.0], 0.0, &mut out);
        let rms = (12.5f32).sqrt();
        assert!((out[0] - 3.0 / rms).abs() < 1e-6 && (out[1] - 8.0 / rms).abs() < 1e-6);
    }
}
