//! Affine-quantized matrices in lily's one layout (MLX's): `w[r][c] = scale[r][g] * q[r][c] + bias[r][g]`, one
//! bf16 scale and bias per group of 64 inputs, `q` packed low bits first into little-endian u32 words (8 values per
//! word at 4 bits, 4 at 8 bits). Checkpoint data stays in the memory map; HF bf16 weights are quantized into owned
//! buffers at load.

use std::sync::Arc;

use half::bf16;

use crate::checkpoint::Buffer;

use crate::config::GROUP_SIZE;

/// A read-only array that lives either in a mapped checkpoint file or in memory.
pub enum Blob<T: bytemuck::Pod> {
    Mapped {
        map: Arc<Buffer>,
        offset: usize,
        len: usize,
        _marker: std::marker::PhantomData<T>,
    },
    Owned(Vec<T>),
}

impl<T: bytemuck::Pod> Blob<T> {
    /// Views `len` elements at byte `offset` of `map`, copying only when the bytes are not aligned for `T`.
    pub fn from_map(map: &Arc<Buffer>, offset: usize, len: usize) -> Blob<T> {
        let bytes = &map[offset..offset + len * std::mem::size_of::<T>()];
        if bytemuck::try_cast_slice::<u8, T>(bytes).is_ok() {
            Blob::Mapped {
                map: map.clone(),
                offset,
                len,
                _marker: std::marker::PhantomData,
            }
        } else {
            Blob::Owned(
                bytes
                    .chunks_exact(std::mem::size_of::<T>())
                    .map(bytemuck::pod_read_unaligned)
                    .collect(),
            )
        }
    }

    pub fn as_slice(&self) -> &[T] {
        match self {
            Blob::Mapped { map, offset, len, .. } => {
                bytemuck::cast_slice(&map[*offset..*offset + *len * std::mem::size_of::<T>()])
            }
            Blob::Owned(v) => v,
        }
    }
}

/// A quantized matrix of `rows x cols` (or a stack of `rows / expert_rows` experts of that many rows each).
pub struct QMatrix {
    pub rows: usize,
    pub cols: usize,
    pub bits: u32,
    pub packed: Blob<u32>,
    pub scales: Blob<bf16>,
    pub biases: Blob<bf16>,
}

/// A borrowed view of some rows of a [`QMatrix`]; what the kernels take.
#[derive(Clone, Copy)]
pub struct QView<'a> {
    pub rows: usize,
    pub cols: usize,
    pub bits: u32,
    pub packed: &'a [u32],
    pub scales: &'a [bf16],
    pub biases: &'a [bf16],
}

pub fn words_per_row(cols: usize, bits: u32) -> usize {
    cols * bits as usize / 32
}

impl QMatrix {
    pub fn view(&self) -> QView<'_> {
        QView {
            rows: self.rows,
            cols: self.cols,
            bits: self.bits,
            packed: self.packed.as_slice(),
            scales: self.scales.as_slice(),
            biases: self.biases.as_slice(),
        }
    }

    /// Rows `start..start + n` (e.g. one expert of a stacked tensor).
    pub fn rows_view(&self, start: usize, n: usize) -> QView<'_> {
        self.view().rows_view(start, n)
    }

    /// Quantizes a row-major f32 matrix (the HF load path and the synthetic generator).
    pub fn quantize(values: &[f32], rows: usize, cols: usize, bits: u32) -> QMatrix {
        assert_eq!(values.len(), rows * cols);
        let groups = cols / GROUP_SIZE;
        let wpr = words_per_row(cols, bits);
        let mut packed = vec![0u32; rows * wpr];
        let mut scales = vec![bf16::ZERO; rows * groups];
        let mut biases = vec![bf16::ZERO; rows * groups];
        for r in 0..rows {
            for g in 0..groups {
                let group = &values[r * cols + g * GROUP_SIZE..r * cols + (g + 1) * GROUP_SIZE];
                let (s, b, q) = quantize_group(group, bits);
                scales[r * groups + g] = s;
                biases[r * groups + g] = b;
                pack_group(&q, bits, &mut packed[r * wpr + g * GROUP_SIZE * bits as usize / 32..]);
            }
        }
        QMatrix {
            rows,
            cols,
            bits,
            packed: Blob::Owned(packed),
            scales: Blob::Owned(scales),
            biases: Blob::Owned(biases),
        }
    }
}

impl<'a> QView<'a> {
    pub fn rows_view(&self, start: usize, n: usize) -> QView<'a> {
        let wpr = words_per_row(self.cols, self.bits);
        let groups = self.cols / GROUP_SIZE;
        QView {
            rows: n,
            cols: self.cols,
            bits: self.bits,
            packed: &self.packed[start * wpr..(start + n) * wpr],
            scales: &self.scales[start * groups..(start + n) * groups],
            biases: &self.biases[start * groups..(start + n) * groups],
        }
    }

    /// Writes row `r` dequantized into `out` (f32, exact: bf16 scale and bias times a small integer).
    #[inline(always)]
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let wpr = words_per_row(self.cols, self.bits);
        let groups = self.cols / GROUP_SIZE;
        let words = &self.packed[r * wpr..(r + 1) * wpr];
        let per_word = 32 / self.bits as usize;
        let mask = (1u32 << self.bits) - 1;
        for g in 0..groups {
            let s = self.scales[r * groups + g].to_f32();
            let b = self.biases[r * groups + g].to_f32();
            for i in 0..GROUP_SIZE {
                let c = g * GROUP_SIZE + i;
                let q = (words[c / per_word] >> ((c % per_word) as u32 * self.bits)) & mask;
                out[c] = s * q as f32 + b;
            }
        }
    }

    /// Dot product of row `r` with `x`, given `x_group_sums[g]` = sum of x over group g.
    #[inline(always)]
    pub fn dot_row(&self, r: usize, x: &[f32], x_group_sums: &[f32]) -> f32 {
        let wpr = words_per_row(self.cols, self.bits);
        let groups = self.cols / GROUP_SIZE;
        let words = &self.packed[r * wpr..(r + 1) * wpr];
        let scales = &self.scales[r * groups..(r + 1) * groups];
        let biases = &self.biases[r * groups..(r + 1) * groups];
        let mut total = 0.0f32;
        match self.bits {
            4 => {
                for g in 0..groups {
                    let xs = &x[g * GROUP_SIZE..(g + 1) * GROUP_SIZE];
                    let ws = &words[g * 8..(g + 1) * 8];
                    let mut acc = [0.0f32; 8];
                    for (w, xw) in ws.iter().zip(xs.chunks_exact(8)) {
                        for j in 0..8 {
                            acc[j] += ((w >> (4 * j)) & 0xF) as f32 * xw[j];
                        }
                    }
                    let qx: f32 = acc.iter().sum();
                    total += scales[g].to_f32() * qx + biases[g].to_f32() * x_group_sums[g];
                }
            }
            8 => {
                for g in 0..groups {
                    let xs = &x[g * GROUP_SIZE..(g + 1) * GROUP_SIZE];
                    let ws = &words[g * 16..(g + 1) * 16];
                    let mut acc = [0.0f32; 4];
                    for (w, xw) in ws.iter().zip(xs.chunks_exact(4)) {
                        for j in 0..4 {
                            acc[j] += ((w >> (8 * j)) & 0xFF) as f32 * xw[j];
                        }
                    }
                    let qx: f32 = acc.iter().sum();
                    total += scales[g].to_f32() * qx + biases[g].to_f32() * x_group_sums[g];
                }
            }
            bits => unreachable!("{bits}-bit matrices are refused at load"),
        }
        total
    }
}

pub fn group_sums(x: &[f32], out: &mut [f32]) {
    for (s, chunk) in out.iter_mut().zip(x.chunks_exact(GROUP_SIZE)) {
        *s = chunk.iter().sum();
    }
}

/// Min/max affine quantization of one group; scale and bias are rounded to bf16 first so that `q` is chosen
/// against the values the kernels will use.
fn quantize_group(group: &[f32], bits: u32) -> (bf16, bf16, Vec<u32>) {
    let levels = ((1u32 << bits) - 1) as f32;
    let (mut lo, mut hi) = (f32::INFINITY, f32::NEG_INFINITY);
    for &v in group {
        lo = lo.min(v);
        hi = hi.max(v);
    }
    let scale = bf16::from_f32(((hi - lo) / levels).max(1e-8));
    let bias = bf16::from_f32(lo);
    let (s, b) = (scale.to_f32(), bias.to_f32());
    let q = group
        .iter()
        .map(|&v| ((v - b) / s).round().clamp(0.0, levels) as u32)
        .collect();
    (scale, bias, q)
}

fn pack_group(q: &[u32], bits: u32, words: &mut [u32]) {
    let per_word = 32 / bits as usize;
    for (i, &v) in q.iter().enumerate() {
        words[i / per_word] |= v << ((i % per_word) as u32 * bits);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn random_values(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = crate::rng::Rng::new(seed);
        (0..n).map(|_| rng.normal()).collect()
    }

    #[test]
    fn quantize_then_dequantize_is_close_and_dot_matches_dequantized_dot() {
        for bits in [4, 8] {
            let (rows, cols) = (7, 192);
            let w = random_values(rows * cols, bits as u64);
            let x = random_values(cols, 99);
            let m = QMatrix::quantize(&w, rows, cols, bits);
            let v = m.view();
            let mut sums = vec![0.0; cols / GROUP_SIZE];
            group_sums(&x, &mut sums);
            let mut row = vec![0.0; cols];
            for r in 0..rows {
                v.dequantize_row(r, &mut row);
                for c in 0..cols {
                    // Half a quantization step, plus bf16 rounding of the scale and bias.
                    let step = v.scales[r * cols / GROUP_SIZE + c / GROUP_SIZE].to_f32();
                    let tolerance = 0.5 * step + 0.02;
                    assert!((row[c] - w[r * cols + c]).abs() <= tolerance, "bits {bits} r {r} c {c}");
                }
                let reference: f64 = row.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum();
                let got = v.dot_row(r, &x, &sums) as f64;
                assert!(
                    (got - reference).abs() < 1e-4 * (1.0 + reference.abs()),
                    "{got} vs {reference}"
                );
            }
        }
    }

    #[test]
    fn rows_view_selects_the_right_rows() {
        let w = random_values(6 * 64, 5);
        let m = QMatrix::quantize(&w, 6, 64, 4);
        let (mut a, mut b) = (vec![0.0; 64], vec![0.0; 64]);
        m.view().dequantize_row(4, &mut a);
        m.rows_view(3, 2).dequantize_row(1, &mut b);
        assert_eq!(a, b);
    }
}
