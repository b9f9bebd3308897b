//! Affine-quantized matrices in lily's one layout (MLX's): `w[r][c] = scale[r][g] * q[r][c] + bias[r][g]`, one
//! bf16 scale and bias per group of 64 inputs, `q` packed low bits first into little-endian u32 words (8 values per
//! word at 4 bits, 4 at 8 bits). Checkpoint data stays in the memory map; HF bf16 weights are quantized into owned
//! buffers at load.

use std::sync::{Arc, OnceLock};

use half::bf16;

use crate::checkpoint::Buffer;

use crate::config::GROUP_SIZE;

/// A read-only array that lives either in a mapped checkpoint file or in memory.
///
/// A mapped array whose bytes are not aligned for `T` (MLX writes safetensors headers without padding) stays in
/// the map: [`Blob::as_bytes`] reads it there, as the GPU upload does, and only [`Blob::as_slice`] copies it, once,
/// on first use. So a load copies no tensor that the chosen backend does not read as a typed slice.
pub enum Blob<T: bytemuck::Pod> {
    Mapped {
        map: Arc<Buffer>,
        offset: usize,
        len: usize,
        /// The aligned copy of unaligned bytes, made on the first `as_slice`.
        copy: OnceLock<Vec<T>>,
    },
    Owned(Vec<T>),
}

impl<T: bytemuck::Pod> Blob<T> {
    /// Views `len` elements at byte `offset` of `map`.
    pub fn from_map(map: &Arc<Buffer>, offset: usize, len: usize) -> Blob<T> {
        assert!(offset + len * std::mem::size_of::<T>() <= map.len());
        Blob::Mapped {
            map: map.clone(),
            offset,
            len,
            copy: OnceLock::new(),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Blob::Mapped { len, .. } => *len,
            Blob::Owned(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The raw little-endian bytes, wherever they lie; never copies.
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            Blob::Mapped { map, offset, len, .. } => &map[*offset..*offset + *len * std::mem::size_of::<T>()],
            Blob::Owned(v) => bytemuck::cast_slice(v),
        }
    }

    /// Whether `as_slice` borrows without copying.
    pub fn is_aligned(&self) -> bool {
        bytemuck::try_cast_slice::<u8, T>(self.as_bytes()).is_ok()
    }

    pub fn as_slice(&self) -> &[T] {
        match self {
            Blob::Mapped { copy, .. } => {
                let bytes = self.as_bytes();
                match bytemuck::try_cast_slice(bytes) {
                    Ok(slice) => slice,
                    Err(_) => copy.get_or_init(|| {
                        bytes
                            .chunks_exact(std::mem::size_of::<T>())
                            .map(bytemuck::pod_read_unaligned)
                            .collect()
                    }),
                }
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
        let mut builder = QMatrixBuilder::new(rows, cols, bits);
        builder.push_rows(values);
        builder.finish()
    }
}

/// Quantizes a matrix a block of rows at a time, so that a caller converting a large bf16 tensor holds only one
/// block of it in f32 (the HF load path streams experts and row blocks through it).
pub struct QMatrixBuilder {
    rows: usize,
    cols: usize,
    bits: u32,
    packed: Vec<u32>,
    scales: Vec<bf16>,
    biases: Vec<bf16>,
}

impl QMatrixBuilder {
    pub fn new(rows: usize, cols: usize, bits: u32) -> QMatrixBuilder {
        assert!(cols.is_multiple_of(GROUP_SIZE) && matches!(bits, 4 | 8));
        QMatrixBuilder {
            rows,
            cols,
            bits,
            packed: Vec::with_capacity(rows * words_per_row(cols, bits)),
            scales: Vec::with_capacity(rows * cols / GROUP_SIZE),
            biases: Vec::with_capacity(rows * cols / GROUP_SIZE),
        }
    }

    /// Appends whole rows (row-major f32, a multiple of `cols` values).
    pub fn push_rows(&mut self, values: &[f32]) {
        assert!(values.len().is_multiple_of(self.cols));
        let wpg = GROUP_SIZE * self.bits as usize / 32;
        for group in values.chunks_exact(GROUP_SIZE) {
            let (s, b, q) = quantize_group(group, self.bits);
            self.scales.push(s);
            self.biases.push(b);
            let start = self.packed.len();
            self.packed.resize(start + wpg, 0);
            pack_group(&q, self.bits, &mut self.packed[start..]);
        }
        assert!(
            self.scales.len() * GROUP_SIZE <= self.rows * self.cols,
            "more rows than the matrix has"
        );
    }

    pub fn finish(self) -> QMatrix {
        assert_eq!(
            self.scales.len() * GROUP_SIZE,
            self.rows * self.cols,
            "fewer rows than the matrix has"
        );
        QMatrix {
            rows: self.rows,
            cols: self.cols,
            bits: self.bits,
            packed: Blob::Owned(self.packed),
            scales: Blob::Owned(self.scales),
            biases: Blob::Owned(self.biases),
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
    fn unaligned_mapped_bytes_stay_mapped_until_read_as_a_slice() {
        let values: Vec<u32> = (0..16).map(|i| i * 0x0101_0101).collect();
        let mut bytes = vec![0xEEu8];
        bytes.extend_from_slice(bytemuck::cast_slice(&values));
        let map = Arc::new(Buffer::Owned(bytes));
        let blob = Blob::<u32>::from_map(&map, 1, 16);
        assert_eq!(blob.as_bytes(), bytemuck::cast_slice::<u32, u8>(&values));
        let Blob::Mapped { copy, .. } = &blob else {
            unreachable!()
        };
        assert!(copy.get().is_none(), "as_bytes copied");
        assert!(!blob.is_aligned());
        assert_eq!(blob.as_slice(), &values[..]);
        let Blob::Mapped { copy, .. } = &blob else {
            unreachable!()
        };
        assert!(
            copy.get().is_some(),
            "as_slice of unaligned bytes reads an aligned copy"
        );
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
