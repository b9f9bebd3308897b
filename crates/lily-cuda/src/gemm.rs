//! The prefill's matrix products on the tensor cores (kernels/gemm.cu): bf16 activations times the 4-bit weights
//! (the router's 8-bit) as they lie in memory, f32 out; the shared expert's gate/up pair with its SwiGLU; the
//! routed experts' grouped products over the entries sorted by expert.
//!
//! Launch geometry (the constants mirror gemm.cu): blocks of 256 threads; a block covers 256 weight rows (a
//! gate/up pair: 128 rows of each) by 64 or 128 activation rows, grid (weight-row blocks, activation-row blocks)
//! for the dense products and (column blocks, tiles) for the grouped ones; dynamic shared memory holds
//! `gemm_stages` pipeline stages of an activation tile (rows x 64 bf16), the packed weight tile (256 rows x 64
//! codes) and its 256 scale/bias pairs.

use half::bf16;
use lily_model::Config;

use crate::driver::{DevPtr, Result};
use crate::kernels::{gemm, Kernels};
use crate::launch::{Dims, Launcher};
use crate::weights::GpuMatrix;

/// Threads of every block (GEMM_THREADS).
const THREADS: u32 = 256;
/// Weight rows a block covers (WROWS).
const WEIGHT_ROWS: usize = 256;
/// Inputs per step of the k loop: one quantization group (KT).
pub(crate) const K_STEP: usize = 64;

/// Dynamic shared memory of a block with `rows`-row activation tiles and `bits`-bit weights (Tile::SMEM).
fn shared_bytes(kernels: &Kernels, rows: usize, bits: u32) -> u32 {
    let stage = rows * K_STEP * 2 + WEIGHT_ROWS * K_STEP * bits as usize / 8 + WEIGHT_ROWS * 4;
    (kernels.constant("gemm_stages") * stage) as u32
}

/// Activation rows per block tile of a dense product: 64 up to m = 64; beyond, 128 unless 64-row tiles finish in
/// fewer rounds of blocks over the SMs (one block per SM; a 64-row tile is taken to cost 0.6 of a 128-row one:
/// half the products, the same dequantization).
fn tile_rows(m: usize, col_blocks: usize, sms: usize) -> usize {
    let rounds = |rows: usize| (m.div_ceil(rows) * col_blocks).div_ceil(sms) as f64;
    if m <= 64 || rounds(64) * 0.6 < rounds(128) {
        64
    } else {
        128
    }
}

/// The kernels infer the tile height from the row-block count, which tells 64 from 128 for every m > 64.
fn dense_grid(m: usize, k: usize, col_blocks: usize, rows: usize) -> (u32, u32, u32) {
    assert!(
        m >= 1 && (rows == 64 || rows == 128 && m > 64),
        "{rows}-row tiles for m = {m}"
    );
    assert!(
        k >= K_STEP && k.is_multiple_of(K_STEP),
        "k = {k} is not whole groups of {K_STEP}"
    );
    assert!(m.div_ceil(rows) <= 65535, "m = {m} is too many row blocks");
    (col_blocks as u32, m.div_ceil(rows) as u32, 1)
}

/// `out[m][n] = a[m][k] w[n][k]^T` (or `+=` with `accumulate`), `a` bf16 and `out` f32 row-major, n = w.rows,
/// k = w.cols; 4-bit or 8-bit by `w.bits`.
pub fn gemm(
    l: &mut Launcher,
    a: DevPtr<bf16>,
    m: usize,
    w: &GpuMatrix,
    out: DevPtr<f32>,
    accumulate: bool,
) -> Result<()> {
    let rows = tile_rows(m, w.rows.div_ceil(WEIGHT_ROWS), l.gpu.sm_count);
    gemm_tiles(l, a, m, w, out, accumulate, rows)
}

pub(crate) fn gemm_tiles(
    l: &mut Launcher,
    a: DevPtr<bf16>,
    m: usize,
    w: &GpuMatrix,
    out: DevPtr<f32>,
    accumulate: bool,
    rows: usize,
) -> Result<()> {
    let launch = match w.bits {
        4 => gemm::gemm_q4,
        8 => gemm::gemm_q8,
        bits => panic!("no {bits}-bit product"),
    };
    let grid = dense_grid(m, w.cols, w.rows.div_ceil(WEIGHT_ROWS), rows);
    let dims = Dims::new(grid, THREADS).shared(shared_bytes(l.kernels, rows, w.bits));
    let (n, k) = (w.rows as i32, w.cols as i32);
    launch(l, dims, a, m as i32, w.q4(), n, k, out, accumulate as i32)
}

/// `out[m][n] = bf16(silu(a gate^T) * (a up^T))`, bf16 `a` and `out` row-major, n = gate.rows, k = gate.cols.
pub fn gemm_swiglu(
    l: &mut Launcher,
    a: DevPtr<bf16>,
    m: usize,
    gate: &GpuMatrix,
    up: &GpuMatrix,
    out: DevPtr<bf16>,
) -> Result<()> {
    let rows = tile_rows(m, gate.rows.div_ceil(WEIGHT_ROWS / 2), l.gpu.sm_count);
    gemm_swiglu_tiles(l, a, m, gate, up, out, rows)
}

pub(crate) fn gemm_swiglu_tiles(
    l: &mut Launcher,
    a: DevPtr<bf16>,
    m: usize,
    gate: &GpuMatrix,
    up: &GpuMatrix,
    out: DevPtr<bf16>,
    rows: usize,
) -> Result<()> {
    assert!(
        gate.bits == 4 && up.bits == 4 && gate.rows == up.rows && gate.cols == up.cols,
        "gate and up: 4-bit, one shape"
    );
    let grid = dense_grid(m, gate.cols, gate.rows.div_ceil(WEIGHT_ROWS / 2), rows);
    let dims = Dims::new(grid, THREADS).shared(shared_bytes(l.kernels, rows, 4));
    let (n, k) = (gate.rows as i32, gate.cols as i32);
    gemm::gemm_q4_swiglu(l, dims, a, m as i32, gate.q4(), up.q4(), n, k, out)
}

/// Tiles of the grouped expert products for `tokens` tokens at most: each expert's sorted entries in tiles of
/// `moe_tile_rows`, so at most one partial tile per expert.
pub fn max_tiles(kernels: &Kernels, config: &Config, tokens: usize) -> usize {
    (tokens * config.num_experts_per_tok).div_ceil(kernels.constant("moe_tile_rows")) + config.num_experts
}

/// The (token, slot) entries sorted by expert, as the grouped products read them: `entries` (i32, sorted index to
/// entry), `offsets` (i32 `[experts + 1]`, each expert's first sorted index), `tiles` (i32 `[max_tiles][2]`: an
/// expert and its tile's first sorted index) and `tile_count` (i32: tiles in use).
pub struct Sorted {
    pub entries: DevPtr<i32>,
    pub tiles: DevPtr<i32>,
    pub tile_count: DevPtr<i32>,
    pub offsets: DevPtr<i32>,
    pub max_tiles: usize,
}

/// Each grouped product's geometry: (column blocks, every possible tile), `gemm_stages` stages of `moe_tile_rows`
/// rows.
fn grouped_dims(l: &Launcher, col_blocks: &'static str, max_tiles: usize) -> Dims {
    let grid = (l.kernels.constant(col_blocks) as u32, max_tiles as u32, 1);
    Dims::new(grid, THREADS).shared(shared_bytes(l.kernels, l.kernels.constant("moe_tile_rows"), 4))
}

/// `act[i][:] = bf16(silu(gate_e x[token]) * (up_e x[token]))` for every sorted entry i (token = entries[i] /
/// top_k, e its expert); `x` bf16 `[tokens][hidden]`, `act` bf16 `[tokens * top_k][moe inter]`. Blocks past
/// `*tile_count` return at once.
pub fn moe_gate_up(
    l: &mut Launcher,
    x: DevPtr<bf16>,
    s: &Sorted,
    gate: &GpuMatrix,
    up: &GpuMatrix,
    act: DevPtr<bf16>,
) -> Result<()> {
    let dims = grouped_dims(l, "moe_gate_up_col_blocks", s.max_tiles);
    gemm::moe_gate_up(
        l,
        dims,
        x,
        s.entries,
        s.tiles,
        s.tile_count,
        s.offsets,
        gate.q4(),
        up.q4(),
        act,
    )
}

/// `out[entries[i]][:] = route_w[entries[i]] * (down_e act[i])` for every sorted entry i; `out` f32
/// `[tokens * top_k][hidden]` and `route_w` f32 `[tokens * top_k]`, both by entry.
pub fn moe_down(
    l: &mut Launcher,
    act: DevPtr<bf16>,
    s: &Sorted,
    route_w: DevPtr<f32>,
    down: &GpuMatrix,
    out: DevPtr<f32>,
) -> Result<()> {
    let dims = grouped_dims(l, "moe_down_col_blocks", s.max_tiles);
    gemm::moe_down(
        l,
        dims,
        act,
        s.entries,
        s.tiles,
        s.tile_count,
        s.offsets,
        route_w,
        down.q4(),
        out,
    )
}
