//! Dense building blocks on the CPU: quantized matrix products on the packed 4/8-bit data (one token's with integer
//! SIMD on its quantized activations, [`matvecs`]; several tokens' in f32 on the weights dequantized a few rows at a
//! time, never a whole matrix, [`gemms`]), RMSNorm, activations.

use rayon::prelude::*;
use smallvec::SmallVec;

use crate::config::MAX_TOP_K;
use crate::quant::QView;

use std::cell::RefCell;
use std::sync::OnceLock;

use super::gemm;
use super::numerics::Rounding;
use super::simd::{self, Path, QInput, Rows};
use super::team::{Shared, Team};

/// The environment variable that forces a SIMD path (`scalar`, `avx2`, `avx512`, `neon`) instead of the fastest one
/// this CPU has.
pub const SIMD_ENV: &str = "LILY_CPU_SIMD";

/// The SIMD path of this process's quantized matrix-vector products: the one [`SIMD_ENV`] names when this CPU can
/// run it, else the fastest available (a name this CPU cannot run is logged and ignored).
pub fn simd_path() -> Path {
    static PATH: OnceLock<Path> = OnceLock::new();
    *PATH.get_or_init(|| {
        let Ok(name) = std::env::var(SIMD_ENV) else {
            return Path::best();
        };
        match Path::from_name(name.trim()) {
            Some(path) if path.is_available() => path,
            Some(path) => {
                tracing::warn!("{SIMD_ENV}={name}: this CPU cannot run the {} path", path.name());
                Path::best()
            }
            None => {
                tracing::warn!("{SIMD_ENV}={name}: not one of scalar, avx2, avx512, neon");
                Path::best()
            }
        }
    })
}

/// A raw output pointer shared by threads that write disjoint elements.
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

/// The packed bytes and bf16 bits of a view, as the SIMD kernels read them.
fn rows_of<'a>(w: &QView<'a>) -> Rows<'a> {
    Rows {
        bits: w.bits,
        cols: w.cols,
        packed: bytemuck::cast_slice(w.packed),
        scales: bytemuck::cast_slice(w.scales),
        biases: bytemuck::cast_slice(w.biases),
    }
}

/// One matrix-vector product of a batch run by [`matvecs`]: `out = w . x`, `x` quantized for `w`'s bits.
pub struct MatVec<'a> {
    pub w: QView<'a>,
    pub x: &'a QInput,
    pub out: &'a mut [f32],
}

impl MatVec<'_> {
    /// A placeholder for unused entries of a fixed-size batch.
    pub fn empty() -> MatVec<'static> {
        static NONE: QInput = QInput::new();
        MatVec {
            w: QView {
                rows: 0,
                cols: 0,
                bits: 4,
                packed: &[],
                scales: &[],
                biases: &[],
            },
            x: &NONE,
            out: &mut [],
        }
    }
}

/// Most products one parallel region takes; [`matvecs`] runs longer batches in parts.
const MAX_BATCH: usize = 24;

/// Runs every product of the batch in one parallel region, rows split into tasks across all threads (a batch's
/// products are independent: e.g. the projections of one input, or the experts of one token).
pub fn matvecs(products: &mut [MatVec]) {
    if products.len() > MAX_BATCH {
        let (head, tail) = products.split_at_mut(MAX_BATCH);
        matvecs(head);
        return matvecs(tail);
    }
    let path = simd_path();
    let n = products.len();
    let mut outs = [SharedOut(std::ptr::null_mut()); MAX_BATCH];
    // Task boundaries: product p owns tasks first_task[p]..first_task[p + 1].
    let mut first_task = [0usize; MAX_BATCH + 1];
    let total_rows: usize = products.iter().map(|p| p.w.rows).sum();
    let rows_per_task = total_rows.div_ceil(16 * rayon::current_num_threads()).clamp(8, 1024);
    for (p, product) in products.iter_mut().enumerate() {
        assert_eq!(product.out.len(), product.w.rows);
        assert_eq!(product.x.bits(), product.w.bits);
        assert_eq!(product.x.cols(), product.w.cols);
        outs[p] = SharedOut(product.out.as_mut_ptr());
        first_task[p + 1] = first_task[p] + product.w.rows.div_ceil(rows_per_task);
    }
    let products = &*products;
    (0..first_task[n]).into_par_iter().for_each(|task| {
        let p = (0..n).find(|&p| task < first_task[p + 1]).expect("task in range");
        let product = &products[p];
        let start = (task - first_task[p]) * rows_per_task;
        let rows = rows_per_task.min(product.w.rows - start);
        // SAFETY: tasks cover disjoint row ranges of each output, which outlives the parallel loop; the pointer
        // is read through the whole array (which is Send) rather than captured as a bare pointer field.
        let out = unsafe { std::slice::from_raw_parts_mut(outs[p].0.add(start), rows) };
        simd::dot_rows(path, rows_of(&product.w.rows_view(start, rows)), product.x, out);
    });
}

/// The products of one step of the team in runs that share a matrix, and the runs' bounds ([`team_matvec_runs`]):
/// inline up to a step of one row's experts (gate and up of each, and one more).
pub type TeamProducts<'a> = SmallVec<[TeamMatVec<'a>; 2 * MAX_TOP_K + 1]>;
pub type TeamRuns = SmallVec<[usize; 2 * MAX_TOP_K + 2]>;

/// One product of a step run by [`team_matvec_runs`]: `out = w . x`, `x` quantized for `w`'s bits.
pub struct TeamMatVec<'a> {
    pub w: QView<'a>,
    pub x: &'a QInput,
    pub out: Shared<'a, [f32]>,
}

thread_local! {
    /// Per thread, the first task of each run of the last [`team_matvec_runs`]: reused so that a step allocates
    /// nothing once the buffer has grown to the longest list of runs.
    static RUN_TASKS: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
}

/// Runs products that share matrices as one parallel step of the team, then waits for all of them. `products`
/// comes in runs of the same matrix: run `g` is `products[runs[g]..runs[g + 1]]`, every entry with the same `w` and
/// its own input and output (the rows of a batched step that read one matrix, or the tokens routed to one expert).
/// A task takes a few rows of one run's matrix and computes them for every input of the run, so those rows are read
/// from memory once for all of its inputs while they are in the core's cache. Each output row is the dot product
/// [`matvecs`] computes, bit for bit. Every thread of the team calls it with the same batch.
pub fn team_matvec_runs(team: &Team, products: &[TeamMatVec], runs: &[usize]) {
    let path = simd_path();
    assert!(
        runs.first() == Some(&0) && runs.last() == Some(&products.len()) && runs.is_sorted(),
        "runs cover the products in order"
    );
    let run = |g: usize| &products[runs[g]..runs[g + 1]];
    let count = runs.len() - 1;
    for g in 0..count {
        let Some(first) = run(g).first() else {
            continue;
        };
        for product in run(g) {
            assert!(
                product.w.packed.as_ptr() == first.w.packed.as_ptr() && product.w.rows == first.w.rows,
                "a run's products share their matrix"
            );
            assert_eq!(product.out.len(), product.w.rows);
            assert_eq!(product.x.bits(), product.w.bits);
            assert_eq!(product.x.cols(), product.w.cols);
        }
    }
    // Tasks of about equal numbers of dot products, about 16 a thread: a run of n inputs takes 1/n as many rows a
    // task (between 8 and 1024).
    let rows = |g: usize| run(g).first().map_or(0, |p| p.w.rows);
    let work: usize = (0..count).map(|g| run(g).len() * rows(g)).sum();
    let per_task = work.div_ceil(16 * team.count()).max(1);
    let rows_per_task = |g: usize| (per_task / run(g).len().max(1)).clamp(8, 1024);
    RUN_TASKS.with_borrow_mut(|first_task| {
        // Run g owns tasks first_task[g]..first_task[g + 1].
        first_task.clear();
        first_task.push(0);
        for g in 0..count {
            let tasks = rows(g).div_ceil(rows_per_task(g));
            first_task.push(first_task[g] + tasks);
        }
        let first_task = &first_task[..];
        team.tasks(first_task[count], |task| {
            let g = first_task.partition_point(|&first| first <= task) - 1;
            let block = rows_per_task(g);
            let start = (task - first_task[g]) * block;
            let n = block.min(rows(g) - start);
            for product in run(g) {
                // SAFETY: the tasks of the step cover disjoint row ranges of each output.
                let out = unsafe { product.out.part(start, n) };
                simd::dot_rows(path, rows_of(&product.w.rows_view(start, n)), product.x, out);
            }
        });
    });
}

thread_local! {
    /// Per thread, the last input quantized for 4-bit and for 8-bit matrices by [`matvecs_of`]: reused so that a
    /// decode step allocates nothing.
    static INPUTS: RefCell<[QInput; 2]> = const { RefCell::new([QInput::new(), QInput::new()]) };
}

/// `out_i = w_i . x` for several matrices of the same width, `x` quantized once per bit width, all in one parallel
/// region.
pub fn matvecs_of(x: &[f32], products: &mut [(QView, &mut [f32])]) {
    // Taken out of the thread-local for the call, so that a nested call (none today) would quantize into fresh
    // buffers rather than find these borrowed.
    let [mut x4, mut x8] = INPUTS.with(|inputs| std::mem::take(&mut *inputs.borrow_mut()));
    if products.iter().any(|(w, _)| w.bits == 4) {
        x4.quantize(x, 4);
    }
    if products.iter().any(|(w, _)| w.bits == 8) {
        x8.quantize(x, 8);
    }
    {
        let mut batch: [MatVec; MAX_BATCH] = std::array::from_fn(|_| MatVec::empty());
        for chunk in products.chunks_mut(MAX_BATCH) {
            let n = chunk.len();
            for (slot, (w, out)) in batch.iter_mut().zip(chunk.iter_mut()) {
                let x = if w.bits == 4 { &x4 } else { &x8 };
                *slot = MatVec { w: *w, x, out };
            }
            matvecs(&mut batch[..n]);
        }
    }
    INPUTS.with(|inputs| *inputs.borrow_mut() = [x4, x8]);
}

/// One product of a batch run by [`gemms`]: `out[t][r] = w[r] . xs[t]` for each token's activations in `xs`
/// (each `w.cols` long), in f32.
pub struct Gemm<'a> {
    pub w: QView<'a>,
    pub xs: &'a [&'a [f32]],
    pub out: &'a mut [f32],
}

thread_local! {
    /// Per thread, the buffers of [`gemm::gemm_rows`] and the outputs of the last task of [`gemms`]: reused from
    /// task to task.
    static GEMM_SCRATCH: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// Runs every product of the batch in one parallel region (e.g. the projections of a slice of tokens, or the
/// experts of a slice with the tokens routed to each), rows split into tasks of about the same number of dot
/// products across all threads. A task runs its rows for every token of its product ([`gemm::gemm_rows`]), so
/// that each row is read from memory and dequantized once.
pub fn gemms(batch: &mut [Gemm]) {
    let rounding = super::numerics::products();
    if rounding != Rounding::Exact && batch.iter().any(|p| p.w.bits == 4) {
        return gemms_rounded(batch, rounding);
    }
    gemms_exact(batch)
}

/// [`gemms`] on the inputs as they are.
fn gemms_exact(batch: &mut [Gemm]) {
    let path = simd_path();
    let n = batch.len();
    let work: usize = batch.iter().map(|p| p.w.rows * p.xs.len()).sum();
    let work_per_task = work.div_ceil(8 * rayon::current_num_threads()).max(1);
    let rows_per_task = |p: &Gemm| {
        (work_per_task / p.xs.len().max(1))
            .clamp(gemm::TASK_ROWS, 1024)
            .next_multiple_of(gemm::TASK_ROWS)
    };
    let mut outs = Vec::with_capacity(n);
    // Product p owns tasks first_task[p]..first_task[p + 1], of rows_per_task(p) rows each (the last fewer).
    let mut first_task = vec![0usize; n + 1];
    for (p, product) in batch.iter_mut().enumerate() {
        assert_eq!(product.out.len(), product.w.rows * product.xs.len());
        assert!(product.xs.iter().all(|x| x.len() == product.w.cols));
        outs.push(SharedOut(product.out.as_mut_ptr()));
        let tasks = if product.xs.is_empty() {
            0
        } else {
            product.w.rows.div_ceil(rows_per_task(product))
        };
        first_task[p + 1] = first_task[p] + tasks;
    }
    let (batch, outs, first_task) = (&*batch, &outs, &first_task);
    (0..first_task[n]).into_par_iter().for_each(|task| {
        let p = first_task.partition_point(|&first| first <= task) - 1;
        let product = &batch[p];
        let block = rows_per_task(product);
        let start = (task - first_task[p]) * block;
        let rows = block.min(product.w.rows - start);
        let tokens = product.xs.len();
        // Taken out of the thread-local for the task (which runs no other task inside it).
        let (mut dequantized, mut values) = GEMM_SCRATCH.with(|s| std::mem::take(&mut *s.borrow_mut()));
        values.resize(tokens * rows, 0.0);
        let w = rows_of(&product.w.rows_view(start, rows));
        gemm::gemm_rows(path, w, product.xs, &mut values, &mut dequantized);
        for (t, values) in values.chunks_exact(rows).enumerate() {
            // SAFETY: tasks cover disjoint row ranges of each token's output, which outlives the parallel loop;
            // the pointer is read through the whole list (which is Send) rather than captured as a bare pointer.
            let out = unsafe { std::slice::from_raw_parts_mut(outs[p].0.add(t * product.w.rows + start), rows) };
            out.copy_from_slice(values);
        }
        GEMM_SCRATCH.with(|s| *s.borrow_mut() = (dequantized, values));
    });
}

/// [`gemms`] with the inputs of the 4-bit products rounded first (the study switch of [`super::numerics`]).
fn gemms_rounded(batch: &mut [Gemm], rounding: Rounding) {
    let rounded: Vec<Vec<Vec<f32>>> = batch
        .iter()
        .map(|p| match p.w.bits {
            4 => {
                p.xs.iter()
                    .map(|x| {
                        let mut x = x.to_vec();
                        rounding.round(&mut x);
                        x
                    })
                    .collect()
            }
            _ => Vec::new(),
        })
        .collect();
    let views: Vec<Vec<&[f32]>> = rounded
        .iter()
        .map(|rows| rows.iter().map(|r| r.as_slice()).collect())
        .collect();
    let mut exact: Vec<Gemm> = batch
        .iter_mut()
        .zip(&views)
        .map(|(p, view)| Gemm {
            w: p.w,
            xs: if p.w.bits == 4 { view } else { p.xs },
            out: &mut *p.out,
        })
        .collect();
    gemms_exact(&mut exact);
}

/// [`qmatmul`] of one input with several matrices of the same width, in one parallel region: for one token with
/// the input quantized ([`matvecs_of`]), for several in f32 ([`gemms`]).
pub fn qmatmuls(x: &[f32], products: &mut [(QView, &mut [f32])]) {
    let Some((first, _)) = products.first() else {
        return;
    };
    let cols = first.cols;
    if x.len() == cols {
        return matvecs_of(x, products);
    }
    assert!(x.len().is_multiple_of(cols));
    let xs: Vec<&[f32]> = x.chunks_exact(cols).collect();
    let mut batch: Vec<Gemm> = products
        .iter_mut()
        .map(|(w, out)| Gemm { w: *w, xs: &xs, out })
        .collect();
    gemms(&mut batch);
}

/// `out[t][r] = sum_c w[r][c] * x[t][c]` for `t` in `0..x.len() / w.cols`.
pub fn qmatmul(w: QView, x: &[f32], out: &mut [f32]) {
    qmatmuls(x, &mut [(w, out)])
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

/// Rows of `width` values per task of the row-wise steps run in parallel: about 16K values, so that a decode
/// step's one row is one task, run in place.
fn rows_per_task(width: usize) -> usize {
    (16 * 1024 / width.max(1)).max(1)
}

/// Zero-centred RMSNorm with the scale stored as `1 + w`, applied to each `scale.len()`-wide row of `x` (rows in
/// parallel).
pub fn rmsnorm(x: &[f32], scale: &[f32], eps: f32, out: &mut [f32]) {
    let n = scale.len();
    x.par_chunks_exact(n)
        .zip(out.par_chunks_exact_mut(n))
        .with_min_len(rows_per_task(n))
        .for_each(|(xr, or)| rmsnorm_row(xr, scale, eps, or));
}

pub fn rmsnorm_in_place(x: &mut [f32], scale: &[f32], eps: f32) {
    let n = scale.len();
    x.par_chunks_exact_mut(n)
        .with_min_len(rows_per_task(n))
        .for_each(|xr| rmsnorm_row_in_place(xr, scale, eps));
}

/// [`rmsnorm`] of one row, on the calling thread.
pub fn rmsnorm_row(x: &[f32], scale: &[f32], eps: f32, out: &mut [f32]) {
    let n = scale.len();
    let mean_sq = x.iter().map(|v| v * v).sum::<f32>() / n as f32;
    let inv = 1.0 / (mean_sq + eps).sqrt();
    for i in 0..n {
        out[i] = x[i] * inv * scale[i];
    }
}

/// [`rmsnorm_in_place`] of one row, on the calling thread.
pub fn rmsnorm_row_in_place(x: &mut [f32], scale: &[f32], eps: f32) {
    let n = scale.len();
    let mean_sq = x.iter().map(|v| v * v).sum::<f32>() / n as f32;
    let inv = 1.0 / (mean_sq + eps).sqrt();
    for i in 0..n {
        x[i] *= inv * scale[i];
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
    use crate::cpu::simd::{self, Path, QInput};
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

    /// Every SIMD path this CPU has, on 4- and 8-bit rows, against the f64 product of the dequantized rows with the
    /// unquantized input, within the bound the three-byte activations allow (a remainder of at most 1/131072 of a
    /// group's step per input) plus f32 rounding; and against the scalar path, which computes the same integers.
    #[test]
    fn every_simd_path_matches_the_dequantized_product_within_the_activation_bound() {
        let mut rng = Rng::new(11);
        let (rows, cols) = (37, 320);
        let paths = Path::available();
        eprintln!("paths: {:?}", paths);
        for bits in [4, 8] {
            let w: Vec<f32> = (0..rows * cols).map(|_| rng.normal()).collect();
            let m = QMatrix::quantize(&w, rows, cols, bits);
            let mut x: Vec<f32> = (0..cols).map(|_| rng.normal()).collect();
            x[64..128].fill(0.0);
            x[130] = 40.0;
            x[200] = -1e-3;
            let mut q = QInput::new();
            q.quantize(&x, bits);
            let mut reference = vec![0.0f32; rows];
            simd::dot_rows(Path::Scalar, rows_of(&m.view()), &q, &mut reference);
            let mut row = vec![0.0; cols];
            let mut outputs = Vec::new();
            for path in &paths {
                let mut out = vec![f32::NAN; rows];
                simd::dot_rows(*path, rows_of(&m.view()), &q, &mut out);
                outputs.push((*path, out.clone()));
                for r in 0..rows {
                    m.view().dequantize_row(r, &mut row);
                    let exact: f64 = (0..cols).map(|c| row[c] as f64 * x[c] as f64).sum();
                    let magnitude: f64 = (0..cols).map(|c| (row[c] as f64 * x[c] as f64).abs()).sum();
                    let bound: f64 = (0..cols)
                        .map(|c| {
                            let group = &x[c / 64 * 64..c / 64 * 64 + 64];
                            let step = group.iter().fold(0.0f32, |a, v| a.max(v.abs())) as f64 / 127.0;
                            row[c].abs() as f64 * step / 131072.0
                        })
                        .sum();
                    let got = out[r] as f64;
                    assert!(
                        (got - exact).abs() <= bound + 1e-6 * magnitude,
                        "{path:?} bits {bits} row {r}: {got} vs {exact} (bound {bound})"
                    );
                    let scalar = reference[r] as f64;
                    assert!(
                        (got - scalar).abs() <= 1e-6 * magnitude,
                        "{path:?} bits {bits} row {r}: {got} vs scalar {scalar}"
                    );
                }
            }
            // The AVX-512 path (4-bit rows in pairs on 512-bit vectors; an odd count leaves one row to the 256-bit
            // loop) does per row what the AVX2 loop does, so the two agree bit for bit.
            let of = |p: Path| outputs.iter().find(|(q, _)| *q == p).map(|(_, out)| out.clone());
            if let (Some(a), Some(b)) = (of(Path::Avx2), of(Path::Avx512)) {
                let same = a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(same, "bits {bits}: the AVX-512 and AVX2 paths differ");
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
