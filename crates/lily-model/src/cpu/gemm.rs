//! f32 products of quantized weight rows with several tokens' activations (the products of a prompt), on the
//! SIMD path the CPU supports: AVX-512, AVX2 with FMA, Arm NEON, or portable code.
//!
//! The weights are dequantized exactly (a bf16 scale times an integer below 256 is exact in f32, and a fused
//! multiply-add with the bf16 bias rounds once, as the unfused sum does) and multiplied with the f32 activations,
//! each dot product summed in the lanes of vectors and then across them: the numbers transformers computes on the
//! dequantized weights, up to the order of the sums. (The one-token products of a decode step quantize the
//! activations instead, which is faster there but loses precision next to outliers of a group: see
//! [`super::simd`].) Every path works in register tiles of [`ROWS`] rows by a few tokens, each vector of weights
//! used for every token of the tile and each vector of activations for every row, so that the weights are read
//! from memory once for all the tokens.
//!
//! AVX-512 dequantizes in registers, inside the tile: per 16 columns of a 4-bit row, one table lookup (`vpermps`)
//! in the group's 16 possible weights. The tokens of a tile stay in the core's first-level cache while the rows
//! pass over them. The other paths, with fewer or narrower registers, dequantize [`ROWS`] rows into a buffer once,
//! then multiply them with every token, tile after tile.
//!
//! This file depends on `std` and [`super::simd`] alone.

use super::simd::{Path, Rows, GROUP};

/// Weight rows of a register tile of the paths that dequantize rows into a buffer.
pub const ROWS: usize = 4;

/// Callers that split a product's rows into tasks make each task's rows a multiple of this (but for the last):
/// whole tiles and AVX-512 panels, so that no task computes rows past its own to fill them.
pub const TASK_ROWS: usize = 32;

#[inline(always)]
fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// `out[t * rows + r] = w[r] . xs[t]` for every row of `w` and every input (each `w.cols` long), on `path` (which
/// must be available: see [`Path::is_available`]). `scratch` holds the paths' dequantized rows and other
/// per-call buffers (grown as needed).
pub fn gemm_rows(path: Path, w: Rows, xs: &[&[f32]], out: &mut [f32], scratch: &mut Vec<f32>) {
    let groups = w.cols / GROUP;
    assert!(matches!(w.bits, 4 | 8) && w.cols.is_multiple_of(GROUP));
    assert!(xs.iter().all(|x| x.len() == w.cols));
    let rows = w.scales.len() / groups.max(1);
    assert!(
        out.len() == rows * xs.len()
            && w.packed.len() == rows * w.cols * w.bits as usize / 8
            && w.scales.len() == rows * groups
            && w.biases.len() == rows * groups
    );
    assert!(
        path.is_available(),
        "the {} path needs CPU features this CPU lacks",
        path.name()
    );
    #[cfg(target_arch = "x86_64")]
    if path == Path::Avx512 {
        if xs.len() >= x86::PANEL_MIN_TOKENS {
            let needed = x86::panel_scratch(xs.len());
            if scratch.len() < needed {
                scratch.resize(needed, 0.0);
            }
            // SAFETY: the CPU has the path's features and the slice lengths were checked above.
            return unsafe { x86::gemm_panels(w, rows, xs, out, &mut scratch[..needed]) };
        }
        if scratch.len() < (TILE_ROWS + xs.len()) * w.cols {
            scratch.resize((TILE_ROWS + xs.len()) * w.cols, 0.0);
        }
        let (tables, interleaved) = scratch.split_at_mut(TILE_ROWS * w.cols);
        if w.bits == 4 {
            // The 4-bit tiles take each 16 activations interleaved (see `x86::tile_avx512_4bit`).
            let mut refs = [&[][..]; x86::PANEL_MIN_TOKENS];
            for ((x, dst), r) in xs.iter().zip(interleaved.chunks_exact_mut(w.cols)).zip(&mut refs) {
                // SAFETY: the CPU has the path's features; `x` and `dst` are `w.cols` long.
                unsafe { x86::interleave(x, dst) };
                *r = dst;
            }
            return gemm_tiles::<x86::Avx512>(w, rows, &refs[..xs.len()], out, tables);
        }
        return gemm_tiles::<x86::Avx512>(w, rows, xs, out, tables);
    }
    if scratch.len() < ROWS * w.cols {
        scratch.resize(ROWS * w.cols, 0.0);
    }
    let scratch = &mut scratch[..ROWS * w.cols];
    match path {
        // SAFETY (each arm): the CPU has the features the function is compiled for (checked above, none for the
        // portable code), and the slice lengths the functions read within were checked above.
        Path::Scalar => unsafe { gemm::<Portable>(w, rows, xs, out, scratch) },
        #[cfg(target_arch = "x86_64")]
        Path::Avx2 => unsafe { x86::gemm_avx2(w, rows, xs, out, scratch) },
        #[cfg(target_arch = "aarch64")]
        Path::Neon => unsafe { arm::gemm_neon(w, rows, xs, out, scratch) },
        #[allow(unreachable_patterns)]
        _ => unreachable!("checked available above"),
    }
}

/// Rows of the register tile of a path that dequantizes in registers: with 4 tokens, 16 accumulators, which with
/// the loads and constants stay within the 32 vector registers.
#[cfg(target_arch = "x86_64")]
const TILE_ROWS: usize = 4;

/// The register tile of a SIMD path that dequantizes in registers ([`gemm_tiles`]).
#[cfg(target_arch = "x86_64")]
trait Tile {
    /// Most tokens of a tile (as many as the vector registers hold with [`TILE_ROWS`] rows).
    const TOKENS: usize;
    /// The dot products of rows `rows` of `w` with the first `T` inputs of `xs`, `[row][token]` (the first `T`
    /// tokens of each row filled). `scratch` (`TILE_ROWS * w.cols` values) holds the rows' constants per group.
    ///
    /// # Safety
    /// The CPU has the path's features; `w`'s slices hold the rows, each input `w.cols` values (as
    /// [`gemm_rows`] checks).
    unsafe fn tile<const T: usize>(
        w: Rows,
        rows: [usize; TILE_ROWS],
        xs: &[&[f32]],
        scratch: &mut [f32],
    ) -> [[f32; 4]; TILE_ROWS];
}

/// The tiles of one SIMD path: tokens [`Tile::TOKENS`] at a time, and in each the rows [`TILE_ROWS`] at a time (the
/// last rows of a partial group repeat the last row; their results are dropped).
#[cfg(target_arch = "x86_64")]
fn gemm_tiles<K: Tile>(w: Rows, rows: usize, xs: &[&[f32]], out: &mut [f32], scratch: &mut [f32]) {
    let mut t = 0;
    while t < xs.len() {
        let tokens = K::TOKENS.min(xs.len() - t);
        for first in (0..rows).step_by(TILE_ROWS) {
            let group = std::array::from_fn(|i| (first + i).min(rows - 1));
            // SAFETY: the caller checked the CPU's features and the slices' lengths.
            let dots = unsafe {
                match tokens {
                    1 => K::tile::<1>(w, group, &xs[t..], scratch),
                    2 => K::tile::<2>(w, group, &xs[t..], scratch),
                    3 => K::tile::<3>(w, group, &xs[t..], scratch),
                    _ => K::tile::<4>(w, group, &xs[t..], scratch),
                }
            };
            for (i, row) in dots.iter().enumerate().take(rows - first) {
                for (k, &v) in row.iter().enumerate().take(tokens) {
                    out[(t + k) * rows + first + i] = v;
                }
            }
        }
        t += tokens;
    }
}

/// The vector operations of one SIMD path that dequantizes rows into a buffer ([`gemm`]). The functions are unsafe because they need the path's CPU features
/// and read `LANES` values behind their pointers.
trait Lanes {
    type V: Copy;
    /// f32 values per vector.
    const LANES: usize;
    /// Most tokens of a register tile (as many as the registers hold with `ROWS` rows).
    const TOKENS: usize;
    unsafe fn zero() -> Self::V;
    unsafe fn load(p: *const f32) -> Self::V;
    /// `acc + a * b`.
    unsafe fn fma(a: Self::V, b: Self::V, acc: Self::V) -> Self::V;
    unsafe fn sum(v: Self::V) -> f32;
    /// Writes row `r` of `w` dequantized into `out` (`w.cols` values).
    unsafe fn dequantize(w: Rows, r: usize, out: &mut [f32]);
}

/// The row-by-token loop of the paths that dequantize rows into a buffer (inlined into each, so compiled with its
/// features).
#[inline(always)]
unsafe fn gemm<L: Lanes>(w: Rows, rows: usize, xs: &[&[f32]], out: &mut [f32], scratch: &mut [f32]) {
    let cols = w.cols;
    for first in (0..rows).step_by(ROWS) {
        let n = ROWS.min(rows - first);
        for (i, row) in scratch.chunks_exact_mut(cols).enumerate() {
            if i < n {
                L::dequantize(w, first + i, row);
            } else {
                // Rows past the end multiply as zeros; their results are dropped.
                row.fill(0.0);
            }
        }
        let mut t = 0;
        while t < xs.len() {
            let tile = L::TOKENS.min(xs.len() - t);
            let mut dots = |values: &[[f32; 4]; ROWS], tile: usize| {
                for (i, row) in values.iter().enumerate().take(n) {
                    for (k, &v) in row.iter().enumerate().take(tile) {
                        out[(t + k) * rows + first + i] = v;
                    }
                }
            };
            match tile {
                1 => dots(&tile_dots::<L, 1>(scratch, cols, &xs[t..]), 1),
                2 => dots(&tile_dots::<L, 2>(scratch, cols, &xs[t..]), 2),
                3 => dots(&tile_dots::<L, 3>(scratch, cols, &xs[t..]), 3),
                _ => dots(&tile_dots::<L, 4>(scratch, cols, &xs[t..]), 4),
            }
            t += tile;
        }
    }
}

/// The dot products of the `ROWS` dequantized rows in `w` (`[ROWS][cols]`) with the first `T` inputs of `xs`, in
/// `ROWS * T` vector accumulators; `[row][token]`, the first `T` tokens of each row filled.
#[inline(always)]
unsafe fn tile_dots<L: Lanes, const T: usize>(w: &[f32], cols: usize, xs: &[&[f32]]) -> [[f32; 4]; ROWS] {
    let x: [*const f32; T] = std::array::from_fn(|k| xs[k].as_ptr());
    let wp = w.as_ptr();
    let mut acc = [[L::zero(); T]; ROWS];
    let mut c = 0;
    while c < cols {
        let wv: [L::V; ROWS] = std::array::from_fn(|i| L::load(wp.add(i * cols + c)));
        let xv: [L::V; T] = std::array::from_fn(|k| L::load(x[k].add(c)));
        for i in 0..ROWS {
            for k in 0..T {
                acc[i][k] = L::fma(wv[i], xv[k], acc[i][k]);
            }
        }
        c += L::LANES;
    }
    let mut dots = [[0.0; 4]; ROWS];
    for i in 0..ROWS {
        for k in 0..T {
            dots[i][k] = L::sum(acc[i][k]);
        }
    }
    dots
}

/// Portable code on arrays of 8 lanes, which the compiler vectorizes for the target's baseline.
struct Portable;

impl Lanes for Portable {
    type V = [f32; 8];
    const LANES: usize = 8;
    const TOKENS: usize = 4;
    #[inline(always)]
    unsafe fn zero() -> [f32; 8] {
        [0.0; 8]
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> [f32; 8] {
        std::ptr::read_unaligned(p as *const [f32; 8])
    }
    #[inline(always)]
    unsafe fn fma(a: [f32; 8], b: [f32; 8], acc: [f32; 8]) -> [f32; 8] {
        // Unfused: `mul_add` is a library call where the target has no fused multiply-add.
        std::array::from_fn(|j| acc[j] + a[j] * b[j])
    }
    #[inline(always)]
    unsafe fn sum(v: [f32; 8]) -> f32 {
        v.iter().sum()
    }
    #[inline(always)]
    unsafe fn dequantize(w: Rows, r: usize, out: &mut [f32]) {
        dequantize_portable(w, r, out)
    }
}

/// Row `r` of `w` dequantized into `out`: value `c` is bits `(c % per_byte) * bits` of byte `c / per_byte` (the
/// packing of little-endian u32 words), times its group's scale, plus its bias.
fn dequantize_portable(w: Rows, r: usize, out: &mut [f32]) {
    let groups = w.cols / GROUP;
    let group_bytes = GROUP * w.bits as usize / 8;
    let mask = (1u32 << w.bits) - 1;
    for g in 0..groups {
        let (scale, bias) = (
            bf16_to_f32(w.scales[r * groups + g]),
            bf16_to_f32(w.biases[r * groups + g]),
        );
        let bytes = &w.packed[(r * groups + g) * group_bytes..(r * groups + g + 1) * group_bytes];
        for (i, o) in out[g * GROUP..(g + 1) * GROUP].iter_mut().enumerate() {
            let bit = i * w.bits as usize;
            let q = (bytes[bit / 8] as u32 >> (bit % 8)) & mask;
            *o = scale * q as f32 + bias;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{bf16_to_f32, gemm, Lanes, Rows, Tile, GROUP, ROWS, TILE_ROWS};

    /// AVX2 and FMA: 8 lanes; 16 vector registers hold [`ROWS`] x 2 accumulators and the loads.
    pub(super) struct Avx2;

    impl Lanes for Avx2 {
        type V = __m256;
        const LANES: usize = 8;
        const TOKENS: usize = 2;
        #[inline(always)]
        unsafe fn zero() -> __m256 {
            _mm256_setzero_ps()
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m256 {
            _mm256_loadu_ps(p)
        }
        #[inline(always)]
        unsafe fn fma(a: __m256, b: __m256, acc: __m256) -> __m256 {
            _mm256_fmadd_ps(a, b, acc)
        }
        #[inline(always)]
        unsafe fn sum(v: __m256) -> f32 {
            let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
            _mm_cvtss_f32(s)
        }
        /// 8 values at a time: one u32 word of 4-bit values shifted per lane, or 8 bytes widened.
        #[inline(always)]
        unsafe fn dequantize(w: Rows, r: usize, out: &mut [f32]) {
            let groups = w.cols / GROUP;
            let group_bytes = GROUP * w.bits as usize / 8;
            let shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
            let mask = _mm256_set1_epi32(0xF);
            let row = w.packed.as_ptr().add(r * groups * group_bytes);
            // The row `ROWS` ahead (the next buffer's), asked for as this one is read: the hardware's prefetchers
            // alone leave the core waiting on memory. (A prefetch past the weights never faults.)
            let ahead = row.wrapping_add(ROWS * groups * group_bytes);
            let o = out.as_mut_ptr();
            for g in 0..groups {
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(g * group_bytes) as *const i8);
                let scale = _mm256_set1_ps(bf16_to_f32(w.scales[r * groups + g]));
                let bias = _mm256_set1_ps(bf16_to_f32(w.biases[r * groups + g]));
                let bytes = row.add(g * group_bytes);
                for k in 0..GROUP / 8 {
                    let q = if w.bits == 4 {
                        let word = (bytes.add(4 * k) as *const u32).read_unaligned();
                        _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(word as i32), shifts), mask)
                    } else {
                        _mm256_cvtepu8_epi32(_mm_loadl_epi64(bytes.add(8 * k) as *const __m128i))
                    };
                    let v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), scale, bias);
                    _mm256_storeu_ps(o.add(g * GROUP + 8 * k), v);
                }
            }
        }
    }

    /// AVX-512: 16 lanes; the 32 vector registers hold [`TILE_ROWS`] x 4 accumulators.
    pub(super) struct Avx512;

    impl Tile for Avx512 {
        const TOKENS: usize = 4;
        #[inline(always)]
        unsafe fn tile<const T: usize>(
            w: Rows,
            rows: [usize; TILE_ROWS],
            xs: &[&[f32]],
            scratch: &mut [f32],
        ) -> [[f32; 4]; TILE_ROWS] {
            if w.bits == 4 {
                tile_avx512_4bit::<T>(w, rows, xs, scratch)
            } else {
                tile_avx512_8bit::<T>(w, rows, xs, scratch)
            }
        }
    }

    /// The sums of the accumulators' lanes.
    #[inline(always)]
    unsafe fn sums<const T: usize>(acc: &[[__m512; T]; TILE_ROWS]) -> [[f32; 4]; TILE_ROWS] {
        let mut dots = [[0.0; 4]; TILE_ROWS];
        for i in 0..TILE_ROWS {
            for t in 0..T {
                dots[i][t] = _mm512_reduce_add_ps(acc[i][t]);
            }
        }
        dots
    }

    /// Fewest tokens for which a product runs in panels ([`gemm_panels`]) rather than in tiles.
    pub(super) const PANEL_MIN_TOKENS: usize = 16;
    /// Rows of a panel: the 16 lanes of two vectors.
    const PANEL: usize = 32;
    /// Columns of a panel's block (a multiple of the group), 32 KB of dequantized weights.
    const BLOCK_COLS: usize = 256;
    /// Tokens of a panel's register tile: 8 tokens by 2 vectors of rows, 16 accumulators.
    const PANEL_TOKENS: usize = 8;

    /// The values of `scratch` that [`gemm_panels`] needs for `tokens` tokens.
    pub(super) fn panel_scratch(tokens: usize) -> usize {
        BLOCK_COLS * PANEL + tokens.next_multiple_of(PANEL_TOKENS) * PANEL
    }

    /// The products of many tokens, with the rows in the vectors' lanes: panels of [`PANEL`] rows, each
    /// dequantized [`BLOCK_COLS`] columns at a time into `scratch`, transposed (column-major, `[column][row]`), then
    /// multiplied with every token in register tiles of [`PANEL_TOKENS`] tokens by the panel's rows, one column at a
    /// time: two vectors of weights, each token's activation broadcast to both, and no sums across lanes. The block
    /// stays in the first-level cache for all the tokens, which are read once per block; the outputs of a token
    /// accumulate in `scratch` from block to block, each summed over the columns in order.
    #[target_feature(enable = "avx2,fma,avx512f,avx512vl")]
    pub(super) unsafe fn gemm_panels(w: Rows, rows: usize, xs: &[&[f32]], out: &mut [f32], scratch: &mut [f32]) {
        let tokens = xs.len();
        let (block, sums) = scratch.split_at_mut(BLOCK_COLS * PANEL);
        let sums = &mut sums[..tokens.next_multiple_of(PANEL_TOKENS) * PANEL];
        for first in (0..rows).step_by(PANEL) {
            let n = PANEL.min(rows - first);
            sums.fill(0.0);
            for start in (0..w.cols).step_by(BLOCK_COLS) {
                let cols = BLOCK_COLS.min(w.cols - start);
                pack_block(w, first, n, start, cols, block);
                for t in (0..tokens).step_by(PANEL_TOKENS) {
                    // The last tile repeats the last token; its extra sums are dropped.
                    let x: [*const f32; PANEL_TOKENS] =
                        std::array::from_fn(|k| xs[(t + k).min(tokens - 1)].as_ptr().add(start));
                    panel_tile(block.as_ptr(), cols, x, sums.as_mut_ptr().add(t * PANEL));
                }
            }
            for (t, sums) in sums.chunks_exact(PANEL).take(tokens).enumerate() {
                out[t * rows + first..t * rows + first + n].copy_from_slice(&sums[..n]);
            }
        }
    }

    /// Dequantizes columns `start..start + cols` of rows `first..first + n` into `block`, transposed: `[column][row]`
    /// with [`PANEL`] rows (those past `n` zero).
    #[inline(always)]
    unsafe fn pack_block(w: Rows, first: usize, n: usize, start: usize, cols: usize, block: &mut [f32]) {
        let groups = w.cols / GROUP;
        let row_bytes = w.cols * w.bits as usize / 8;
        let iota = _mm512_setr_ps(
            0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
        );
        let shifts = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
        let words = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
        let out = block.as_mut_ptr();
        let wide = if w.bits == 4 { cols / WIDE_COLS * WIDE_COLS } else { 0 };
        for c in (0..wide).step_by(WIDE_COLS) {
            for half in 0..PANEL / 16 {
                pack_4bit_wide(
                    w,
                    first + half * 16,
                    n.saturating_sub(half * 16).min(16),
                    start + c,
                    out.add(c * PANEL + half * 16),
                );
            }
        }
        for c in (wide..cols).step_by(16) {
            let (col, g) = (start + c, (start + c) / GROUP);
            for half in 0..PANEL / 16 {
                let mut v = [_mm512_setzero_ps(); 16];
                for (i, v) in v.iter_mut().enumerate() {
                    let r = half * 16 + i;
                    if r >= n {
                        break;
                    }
                    let r = first + r;
                    let scale = _mm512_set1_ps(bf16_to_f32(w.scales[r * groups + g]));
                    let bias = _mm512_set1_ps(bf16_to_f32(w.biases[r * groups + g]));
                    let row = w.packed.as_ptr().add(r * row_bytes);
                    *v = if w.bits == 4 {
                        let pair = _mm_loadl_epi64(row.add(col / 2) as *const __m128i);
                        let spread = _mm512_permutexvar_epi32(words, _mm512_castsi128_si512(pair));
                        _mm512_permutexvar_ps(_mm512_srlv_epi32(spread, shifts), _mm512_fmadd_ps(iota, scale, bias))
                    } else {
                        let bytes = _mm_loadu_si128(row.add(col) as *const __m128i);
                        _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes)), scale, bias)
                    };
                }
                transpose16(&mut v);
                for (j, v) in v.iter().enumerate() {
                    _mm512_storeu_ps(out.add((c + j) * PANEL + half * 16), *v);
                }
            }
        }
    }

    /// Columns of 4-bit rows that [`pack_4bit_wide`] dequantizes at a time: the 16 words of 8 weights in 64 bytes.
    const WIDE_COLS: usize = 128;

    /// Dequantizes columns `col..col + WIDE_COLS` of the `n` (at most 16) rows from `first` into `out`, transposed:
    /// `out[c * PANEL + i]` is column `col + c` of row `first + i` (zero for `i >= n`). The rows' 64 bytes are
    /// transposed as 16 words, so that vector `j` holds word `j` of every row, the weights of 8 columns; then each
    /// column is a shift, a mask, a conversion and a multiply-add with the rows' scales and biases in the lanes.
    /// (So the transposition moves 8 columns per word rather than one per value, and no table is made per row.)
    #[inline(always)]
    unsafe fn pack_4bit_wide(w: Rows, first: usize, n: usize, col: usize, out: *mut f32) {
        let groups = w.cols / GROUP;
        let row_bytes = w.cols / 2;
        let mut v = [_mm512_setzero_ps(); 16];
        for (i, v) in v.iter_mut().enumerate().take(n) {
            *v = _mm512_loadu_ps(w.packed.as_ptr().add((first + i) * row_bytes + col / 2) as *const f32);
        }
        transpose16(&mut v);
        let mask = _mm512_set1_epi32(0xF);
        for g in 0..WIDE_COLS / GROUP {
            let (mut scales, mut biases) = ([0.0f32; 16], [0.0f32; 16]);
            for i in 0..n {
                let index = (first + i) * groups + col / GROUP + g;
                scales[i] = bf16_to_f32(w.scales[index]);
                biases[i] = bf16_to_f32(w.biases[index]);
            }
            let (scale, bias) = (_mm512_loadu_ps(scales.as_ptr()), _mm512_loadu_ps(biases.as_ptr()));
            for j in 0..GROUP / 8 {
                let word = _mm512_castps_si512(v[g * GROUP / 8 + j]);
                for k in 0..8 {
                    let q = _mm512_and_si512(_mm512_srlv_epi32(word, _mm512_set1_epi32(4 * k as i32)), mask);
                    let c = g * GROUP + 8 * j + k;
                    _mm512_storeu_ps(out.add(c * PANEL), _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), scale, bias));
                }
            }
        }
    }

    /// Transposes 16 vectors of 16 values: afterwards `v[j]` holds lane `j` of every vector, in order.
    #[inline(always)]
    unsafe fn transpose16(v: &mut [__m512; 16]) {
        // Pairs of rows interleaved by 32 bits within each 128-bit lane, then pairs of those by 64 bits: vector
        // 4q + k then holds, in lane l, column 4l + k of rows 4q..4q + 4.
        let mut t = [_mm512_setzero_ps(); 16];
        for i in 0..8 {
            t[2 * i] = _mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]);
        }
        let pd = _mm512_castps_pd;
        for q in 0..4 {
            let (a, b, c, d) = (t[4 * q], t[4 * q + 1], t[4 * q + 2], t[4 * q + 3]);
            v[4 * q] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(a), pd(c)));
            v[4 * q + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(a), pd(c)));
            v[4 * q + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(b), pd(d)));
            v[4 * q + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(b), pd(d)));
        }
        // Then the 128-bit lanes: column 4l + k gathers lane l of vectors k, 4 + k, 8 + k and 12 + k.
        for k in 0..4 {
            let low = _mm512_shuffle_f32x4::<0x44>(v[k], v[4 + k]);
            let high = _mm512_shuffle_f32x4::<0xEE>(v[k], v[4 + k]);
            let low2 = _mm512_shuffle_f32x4::<0x44>(v[8 + k], v[12 + k]);
            let high2 = _mm512_shuffle_f32x4::<0xEE>(v[8 + k], v[12 + k]);
            t[k] = _mm512_shuffle_f32x4::<0x88>(low, low2);
            t[4 + k] = _mm512_shuffle_f32x4::<0xDD>(low, low2);
            t[8 + k] = _mm512_shuffle_f32x4::<0x88>(high, high2);
            t[12 + k] = _mm512_shuffle_f32x4::<0xDD>(high, high2);
        }
        *v = t;
    }

    /// `sums[t][r] += sum over columns c of block[c][r] * x[t][c]` for the [`PANEL_TOKENS`] tokens and the
    /// [`PANEL`] rows, column after column.
    #[inline(always)]
    unsafe fn panel_tile(block: *const f32, cols: usize, x: [*const f32; PANEL_TOKENS], sums: *mut f32) {
        let mut acc = [[_mm512_setzero_ps(); 2]; PANEL_TOKENS];
        for (t, acc) in acc.iter_mut().enumerate() {
            acc[0] = _mm512_loadu_ps(sums.add(t * PANEL));
            acc[1] = _mm512_loadu_ps(sums.add(t * PANEL + 16));
        }
        for c in 0..cols {
            let w0 = _mm512_loadu_ps(block.add(c * PANEL));
            let w1 = _mm512_loadu_ps(block.add(c * PANEL + 16));
            for (acc, x) in acc.iter_mut().zip(&x) {
                let xb = _mm512_set1_ps(*x.add(c));
                acc[0] = _mm512_fmadd_ps(w0, xb, acc[0]);
                acc[1] = _mm512_fmadd_ps(w1, xb, acc[1]);
            }
        }
        for (t, acc) in acc.iter().enumerate() {
            _mm512_storeu_ps(sums.add(t * PANEL), acc[0]);
            _mm512_storeu_ps(sums.add(t * PANEL + 16), acc[1]);
        }
    }

    /// Copies `x` to `out` with each 16 values interleaved as the 4-bit tiles' weights are: `out[16b + 2i] =
    /// x[16b + i]`, `out[16b + 2i + 1] = x[16b + 8 + i]`.
    #[target_feature(enable = "avx2,fma,avx512f,avx512vl")]
    pub(super) unsafe fn interleave(x: &[f32], out: &mut [f32]) {
        let order = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
        for (x, out) in x.chunks_exact(16).zip(out.chunks_exact_mut(16)) {
            _mm512_storeu_ps(
                out.as_mut_ptr(),
                _mm512_permutexvar_ps(order, _mm512_loadu_ps(x.as_ptr())),
            );
        }
    }

    /// Asks for the cache line at `p` (which may lie past the weights: a prefetch never faults). A tile prefetches
    /// the rows of the next tile, which follow its own in memory, as it goes: the hardware's prefetchers alone leave
    /// the core waiting on memory.
    #[inline(always)]
    unsafe fn prefetch(p: *const u8) {
        _mm_prefetch::<_MM_HINT_T0>(p as *const i8);
    }

    /// The row pointers of a tile and the token pointers.
    #[inline(always)]
    unsafe fn pointers<const T: usize>(
        w: Rows,
        rows: [usize; TILE_ROWS],
        xs: &[&[f32]],
    ) -> ([*const u8; TILE_ROWS], [*const f32; T]) {
        let row_bytes = w.cols * w.bits as usize / 8;
        let mut packed = [w.packed.as_ptr(); TILE_ROWS];
        for i in 0..TILE_ROWS {
            packed[i] = packed[i].add(rows[i] * row_bytes);
        }
        let mut x = [xs[0].as_ptr(); T];
        for t in 0..T {
            x[t] = xs[t].as_ptr();
        }
        (packed, x)
    }

    /// 16 columns of 4-bit weights at a time: per row and group, the group's 16 possible weights (`scale * q +
    /// bias` for `q` below 16) as a table in `scratch`, and the 8 bytes of the 16 weights broadcast to every 64-bit
    /// lane and shifted per 32-bit lane, so that the low 4 bits of lane `2i` are weight `i` and those of lane `2i +
    /// 1` weight `8 + i`, which pick their entries of the table. The activations come interleaved the same way
    /// ([`interleave`]). (The tables are made before the loop, and the loop runs 16 columns per iteration rather
    /// than four times that per group, so that its live vectors fit the registers.)
    #[target_feature(enable = "avx2,fma,avx512f,avx512vl")]
    unsafe fn tile_avx512_4bit<const T: usize>(
        w: Rows,
        rows: [usize; TILE_ROWS],
        xs: &[&[f32]],
        scratch: &mut [f32],
    ) -> [[f32; 4]; TILE_ROWS] {
        let groups = w.cols / GROUP;
        let iota = _mm512_setr_ps(
            0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
        );
        let (tables, constants) = scratch.split_at_mut(TILE_ROWS * groups * 16);
        let (scales, biases) = constants[..2 * groups].split_at_mut(groups);
        let tables = tables.as_mut_ptr();
        for (i, &r) in rows.iter().enumerate() {
            widen_bf16(&w.scales[r * groups..(r + 1) * groups], scales);
            widen_bf16(&w.biases[r * groups..(r + 1) * groups], biases);
            for g in 0..groups {
                let (scale, bias) = (_mm512_set1_ps(scales[g]), _mm512_set1_ps(biases[g]));
                _mm512_storeu_ps(tables.add((i * groups + g) * 16), _mm512_fmadd_ps(iota, scale, bias));
            }
        }
        let shifts = _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28);
        let (packed, x) = pointers::<T>(w, rows, xs);
        let mut acc = [[_mm512_setzero_ps(); T]; TILE_ROWS];
        let next = packed[0].wrapping_add(TILE_ROWS * w.cols / 2);
        for c in (0..w.cols).step_by(16) {
            let g = c / GROUP;
            prefetch(next.wrapping_add(c * TILE_ROWS / 2));
            let mut xv = [_mm512_setzero_ps(); T];
            for t in 0..T {
                xv[t] = _mm512_loadu_ps(x[t].add(c));
            }
            for i in 0..TILE_ROWS {
                let pair = _mm512_set1_epi64((packed[i].add(c / 2) as *const i64).read_unaligned());
                let table = _mm512_loadu_ps(tables.add((i * groups + g) * 16));
                let wv = _mm512_permutexvar_ps(_mm512_srlv_epi32(pair, shifts), table);
                for t in 0..T {
                    acc[i][t] = _mm512_fmadd_ps(wv, xv[t], acc[i][t]);
                }
            }
        }
        sums(&acc)
    }

    /// `out[i] = src[i]` as f32 (`src` holding bf16 bits), 16 values at a time.
    #[inline(always)]
    unsafe fn widen_bf16(src: &[u16], out: &mut [f32]) {
        let n = src.len();
        assert!(out.len() >= n);
        let mut i = 0;
        while i + 16 <= n {
            let bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256(src.as_ptr().add(i) as *const __m256i));
            _mm512_storeu_ps(
                out.as_mut_ptr().add(i),
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(bits)),
            );
            i += 16;
        }
        for i in i..n {
            out[i] = bf16_to_f32(src[i]);
        }
    }

    /// 16 columns of 8-bit weights at a time: 16 bytes widened, times the scale plus the bias (per row and group,
    /// in `scratch`).
    #[target_feature(enable = "avx2,fma,avx512f,avx512vl")]
    unsafe fn tile_avx512_8bit<const T: usize>(
        w: Rows,
        rows: [usize; TILE_ROWS],
        xs: &[&[f32]],
        scratch: &mut [f32],
    ) -> [[f32; 4]; TILE_ROWS] {
        let groups = w.cols / GROUP;
        let (scales, biases) = scratch[..2 * TILE_ROWS * groups].split_at_mut(TILE_ROWS * groups);
        for (i, &r) in rows.iter().enumerate() {
            for g in 0..groups {
                scales[i * groups + g] = bf16_to_f32(w.scales[r * groups + g]);
                biases[i * groups + g] = bf16_to_f32(w.biases[r * groups + g]);
            }
        }
        let (packed, x) = pointers::<T>(w, rows, xs);
        let mut acc = [[_mm512_setzero_ps(); T]; TILE_ROWS];
        let next = packed[0].wrapping_add(TILE_ROWS * w.cols);
        for c in (0..w.cols).step_by(16) {
            let g = c / GROUP;
            prefetch(next.wrapping_add(c * TILE_ROWS));
            let mut xv = [_mm512_setzero_ps(); T];
            for t in 0..T {
                xv[t] = _mm512_loadu_ps(x[t].add(c));
            }
            for i in 0..TILE_ROWS {
                let bytes = _mm_loadu_si128(packed[i].add(c) as *const __m128i);
                let q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
                let (scale, bias) = (scales[i * groups + g], biases[i * groups + g]);
                let wv = _mm512_fmadd_ps(q, _mm512_set1_ps(scale), _mm512_set1_ps(bias));
                for t in 0..T {
                    acc[i][t] = _mm512_fmadd_ps(wv, xv[t], acc[i][t]);
                }
            }
        }
        sums(&acc)
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn gemm_avx2(w: Rows, rows: usize, xs: &[&[f32]], out: &mut [f32], scratch: &mut [f32]) {
        gemm::<Avx2>(w, rows, xs, out, scratch)
    }
}

#[cfg(target_arch = "aarch64")]
mod arm {
    use std::arch::aarch64::*;

    use super::{bf16_to_f32, gemm, Lanes, Rows, GROUP};

    /// NEON: 4 lanes; 32 vector registers hold `ROWS` x 4 accumulators and the loads.
    pub(super) struct Neon;

    impl Lanes for Neon {
        type V = float32x4_t;
        const LANES: usize = 4;
        const TOKENS: usize = 4;
        #[inline(always)]
        unsafe fn zero() -> float32x4_t {
            vdupq_n_f32(0.0)
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> float32x4_t {
            vld1q_f32(p)
        }
        #[inline(always)]
        unsafe fn fma(a: float32x4_t, b: float32x4_t, acc: float32x4_t) -> float32x4_t {
            vfmaq_f32(acc, a, b)
        }
        #[inline(always)]
        unsafe fn sum(v: float32x4_t) -> f32 {
            vaddvq_f32(v)
        }
        /// 8 values at a time: one u32 word of 4-bit values shifted per lane into two vectors, or 8 bytes widened.
        #[inline(always)]
        unsafe fn dequantize(w: Rows, r: usize, out: &mut [f32]) {
            let groups = w.cols / GROUP;
            let group_bytes = GROUP * w.bits as usize / 8;
            let low_shifts = vld1q_s32([0, -4, -8, -12].as_ptr());
            let high_shifts = vld1q_s32([-16, -20, -24, -28].as_ptr());
            let mask = vdupq_n_u32(0xF);
            let row = w.packed.as_ptr().add(r * groups * group_bytes);
            let o = out.as_mut_ptr();
            for g in 0..groups {
                let scale = bf16_to_f32(w.scales[r * groups + g]);
                let bias = vdupq_n_f32(bf16_to_f32(w.biases[r * groups + g]));
                let bytes = row.add(g * group_bytes);
                for k in 0..GROUP / 8 {
                    let (low, high) = if w.bits == 4 {
                        let word = vdupq_n_u32((bytes.add(4 * k) as *const u32).read_unaligned());
                        (
                            vandq_u32(vshlq_u32(word, low_shifts), mask),
                            vandq_u32(vshlq_u32(word, high_shifts), mask),
                        )
                    } else {
                        let wide = vmovl_u8(vld1_u8(bytes.add(8 * k)));
                        (vmovl_u16(vget_low_u16(wide)), vmovl_u16(vget_high_u16(wide)))
                    };
                    vst1q_f32(o.add(g * GROUP + 8 * k), vfmaq_n_f32(bias, vcvtq_f32_u32(low), scale));
                    vst1q_f32(
                        o.add(g * GROUP + 8 * k + 4),
                        vfmaq_n_f32(bias, vcvtq_f32_u32(high), scale),
                    );
                }
            }
        }
    }

    #[target_feature(enable = "neon")]
    pub(super) unsafe fn gemm_neon(w: Rows, rows: usize, xs: &[&[f32]], out: &mut [f32], scratch: &mut [f32]) {
        gemm::<Neon>(w, rows, xs, out, scratch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{QMatrix, QView};
    use crate::rng::Rng;

    fn rows_of<'a>(w: &QView<'a>) -> Rows<'a> {
        Rows {
            bits: w.bits,
            cols: w.cols,
            packed: bytemuck::cast_slice(w.packed),
            scales: bytemuck::cast_slice(w.scales),
            biases: bytemuck::cast_slice(w.biases),
        }
    }

    /// Every path dequantizes exactly: the products with the unit vectors (one per column) are the weights of
    /// [`QView::dequantize_row`], whether the unit vectors come a few at a time or all at once (the two ways of
    /// the AVX-512 path).
    #[test]
    fn every_path_dequantizes_exactly() {
        let mut rng = Rng::new(29);
        let (rows, cols) = (6, 128);
        let units: Vec<f32> = (0..cols * cols)
            .map(|i| if i % (cols + 1) == 0 { 1.0 } else { 0.0 })
            .collect();
        let xs: Vec<&[f32]> = units.chunks_exact(cols).collect();
        for bits in [4, 8] {
            let w: Vec<f32> = (0..rows * cols).map(|_| rng.normal() * 3.0).collect();
            let m = QMatrix::quantize(&w, rows, cols, bits);
            let mut expected = vec![0.0; cols];
            for path in Path::available() {
                for per_call in [5, cols] {
                    for (call, xs) in xs.chunks(per_call).enumerate() {
                        let mut out = vec![f32::NAN; xs.len() * rows];
                        gemm_rows(path, rows_of(&m.view()), xs, &mut out, &mut Vec::new());
                        for r in 0..rows {
                            m.view().dequantize_row(r, &mut expected);
                            for t in 0..xs.len() {
                                let c = call * per_call + t;
                                assert_eq!(
                                    out[t * rows + r],
                                    expected[c],
                                    "{path:?} bits {bits} row {r} column {c}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// Every path, on 4- and 8-bit rows, row counts that do and do not fill the register tiles and panels, token
    /// counts that do and do not fill them (and that take either way of the AVX-512 path) and widths that do and do
    /// not fill a panel's block, against the f64 product of the dequantized rows with the inputs, within f32
    /// rounding of the sum of the products' magnitudes.
    #[test]
    fn every_path_matches_the_dequantized_product() {
        let mut rng = Rng::new(31);
        for cols in [256, 384] {
            for bits in [4, 8] {
                for rows in [1, 4, 7, 33] {
                    let w: Vec<f32> = (0..rows * cols).map(|_| rng.normal()).collect();
                    let m = QMatrix::quantize(&w, rows, cols, bits);
                    for tokens in [1, 2, 3, 4, 5, 8, 9, 17, 40] {
                        let x: Vec<f32> = (0..tokens * cols).map(|_| rng.normal()).collect();
                        let xs: Vec<&[f32]> = x.chunks_exact(cols).collect();
                        let mut row = vec![0.0; cols];
                        for path in Path::available() {
                            let mut out = vec![f32::NAN; tokens * rows];
                            gemm_rows(path, rows_of(&m.view()), &xs, &mut out, &mut Vec::new());
                            for r in 0..rows {
                                m.view().dequantize_row(r, &mut row);
                                for (t, x) in xs.iter().enumerate() {
                                    let products = row.iter().zip(*x).map(|(&a, &b)| a as f64 * b as f64);
                                    let exact: f64 = products.clone().sum();
                                    let magnitude: f64 = products.map(f64::abs).sum();
                                    let got = out[t * rows + r] as f64;
                                    assert!(
                                        (got - exact).abs() <= 1e-6 * magnitude,
                                        "{path:?} cols {cols} bits {bits} rows {rows} tokens {tokens} ({r}, {t}): \
                                         {got} vs {exact}"
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}
