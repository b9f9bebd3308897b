//! The prefill's matrix products on the tensor cores (kernels/gemm.cu): bf16 activations times the 4-bit weights
//! (the router's 8-bit) as they lie in memory, f32 out; the experts' grouped products over the entries sorted by
//! expert (the shared expert is one more expert there), gate/up with their SwiGLU and down.
//!
//! Launch geometry (the constants mirror gemm.cu): blocks of 256 threads; a block covers 256 weight rows (a
//! gate/up pair: 128 rows of each) by 64 or 128 activation rows, grid (weight-row blocks, activation-row blocks)
//! for the dense products and (column blocks, tiles) for the grouped ones; dynamic shared memory holds
//! `gemm_stages` pipeline stages of an activation tile (rows x 64 bf16), the packed weight tile (256 rows x 64
//! codes) and its 256 scale/bias pairs. On Hopper the 4-bit products in 128-row tiles take the warpgroup MMA
//! (`gemm_q4_wgmma`, which also keeps three dequantized bf16 weight tiles there; its blocks cover 256, 192 or 128
//! weight rows, whichever fills the SMs best), and so does the experts' gate/up for long routings; the mma.sync
//! kernels are the path of every other GPU. The dense warpgroup products of row-major matrices with k a multiple of
//! 256 take their operands through the tensor memory accelerator (`gemm_q4_wgmma_tma`: the host encodes a tensor
//! map of the activations, of the packed codes and of their pairs for each launch, `tma_maps`); those whose output
//! rows are 16-byte aligned take the weights as wgmma's A operand from registers, each consumer thread dequantizing
//! its own fragment, in blocks of 128 weight rows by 256 activation rows stored through a tensor map of the output
//! (`gemm_q4_wgmma_rs`, 384 threads a block: a warpgroup that copies and two that multiply).
//!
//! Few rows (a short prompt, a batched decode step) give few block tiles. Up to `gemm_small_max_rows` rows the 4-bit
//! dense products of few blocks (not lm_head past 32 rows) take the experts' integer small tiling: the rows coded
//! as Q8x2 once (by the norm that wrote them where it can: [`small_codes`]), then a block per 256 weight rows (128
//! where the 256-row blocks would leave the SMs' block slots empty), 16 activation rows and part of k. The 8-bit
//! ones, and the other 4-bit ones up to 512 rows, cut k into parts of bf16 64-row tiles. Either way, where k is
//! cut, each block writes its partial tile and a second launch sums every output element's parts in order (see the
//! split products in gemm.cu and [`Plan`]).
//!
//! The grouped products of up to 512 tokens (a few entries per expert) take the small tiling: 16-row tiles on the
//! integer tensor cores, the activations as two 8-bit digits an input ([`SmallCodes`]), gate/up and down in one
//! persistent launch (`moe_small`, its shared memory read from the kernels' constants). Longer prompts take 64-row
//! tiles, except on Hopper from `moe_rs_min_tokens` tokens (by default every prompt past the small tiling): there
//! they take 128-row tiles whose gate/up runs on the warpgroup MMA with the weights in registers (`moe_gate_up_rs`;
//! `moe_gate_up_wgmma` from `moe_wgmma_min_tokens` where the build has not that kernel) and whose down runs on
//! mma.sync in two 64-row parts.

use half::bf16;
use lily_model::Config;

use crate::driver::{DevBuf, DevPtr, Gpu, Result};
use crate::kernels::{gemm, Kernels, Q8x2, TensorMap};
use crate::launch::{Dims, Launcher};
use crate::weights::{GpuMatrix, Layout};

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
/// half the products, the same dequantization). `wide_cost` is what a 128-row tile costs against the mma.sync one:
/// 1, or `gemm_wgmma_cost` / 100 where the warpgroup kernel takes it.
fn tile_rows(m: usize, col_blocks: usize, sms: usize, wide_cost: f64) -> usize {
    let rounds = |rows: usize| (m.div_ceil(rows) * col_blocks).div_ceil(sms) as f64;
    if m <= 64 || rounds(64) * 0.6 < rounds(128) * wide_cost {
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

/// How a dense product is launched: whole-k block tiles of 64 or 128 rows, 128-row tiles of `cols` weight rows on
/// the warpgroup tensor cores (4-bit, where the kernels were built for Hopper), 64-row tiles with k cut into `parts`
/// parts (the split kernels), or the integer small tiling in blocks of `cols` weight rows (256, or 128: the narrow
/// blocks) with k in `parts` parts (4-bit, few rows).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Plan {
    Tiles(usize),
    Wgmma(usize),
    WgmmaSplit(usize),
    Split(usize),
    Small { parts: usize, cols: usize },
}

/// Inputs of a piece of k in the small tiling (TILED_PIECE): its parts of k are whole pieces.
const PIECE: usize = 2 * K_STEP;

/// Whether the integer small tiling can take a 4-bit product of m rows and k inputs (its codes buffer's rows and
/// width, whole pieces).
pub(crate) fn small_fits(kernels: &Kernels, bits: u32, m: usize, k: usize) -> bool {
    bits == 4
        && m <= kernels.constant("gemm_small_rows_cap")
        && k <= kernels.constant("gemm_small_max_k")
        && k.is_multiple_of(PIECE)
}

/// The small tiling's dense products of m rows in blocks of `cols` weight rows (256 or 128): which kernel takes them
/// and its tile height, shared memory and blocks an SM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SmallKernel {
    /// `gemm_q4_small`: 256 weight rows, tiles of `moe_small_tile_rows` rows.
    Wide,
    /// `gemm_q4_small_narrow`: 128 weight rows, tiles of `moe_small_tile_rows` rows.
    Narrow,
    /// `gemm_q4_small_tall`: 128 weight rows, tiles of `gemm_small_tall_rows` rows, for products of more rows than
    /// one short tile (where `gemm_small_tall` is 1).
    Tall,
}

impl SmallKernel {
    fn of(kernels: &Kernels, m: usize, cols: usize) -> SmallKernel {
        match cols {
            WEIGHT_ROWS => SmallKernel::Wide,
            _ if kernels.constant("gemm_small_tall") == 1 && m > kernels.constant("moe_small_tile_rows") => {
                SmallKernel::Tall
            }
            _ => SmallKernel::Narrow,
        }
    }

    fn smem(self, kernels: &Kernels) -> usize {
        kernels.constant(match self {
            SmallKernel::Wide => "gemm_small_smem",
            SmallKernel::Narrow => "gemm_small_narrow_smem",
            SmallKernel::Tall => "gemm_small_tall_smem",
        })
    }

    fn blocks_per_sm(self, kernels: &Kernels) -> usize {
        kernels.constant(match self {
            SmallKernel::Wide => "gemm_small_blocks_per_sm",
            SmallKernel::Narrow => "gemm_small_narrow_blocks_per_sm",
            SmallKernel::Tall => "gemm_small_tall_blocks_per_sm",
        })
    }

    fn tile_rows(self, kernels: &Kernels) -> usize {
        kernels.constant(match self {
            SmallKernel::Tall => "gemm_small_tall_rows",
            _ => "moe_small_tile_rows",
        })
    }
}

/// The small tiling's parts of k for m rows, n weight rows in blocks of `cols` and k inputs: one part where the
/// blocks of (weight rows, activation rows) fill the SMs (as many blocks an SM as fit); otherwise as many as fill
/// them, each at least `gemm_small_min_pieces` pieces, within the split products' slots (tiles of 256 columns).
fn small_parts(kernels: &Kernels, m: usize, n: usize, cols: usize, k: usize, sms: usize) -> usize {
    let blocks = n.div_ceil(cols) * small_row_tiles(kernels, m, cols);
    let slots = n.div_ceil(WEIGHT_ROWS) * m.div_ceil(kernels.constant("gemm_split_rows"));
    let target = SmallKernel::of(kernels, m, cols).blocks_per_sm(kernels) * sms;
    (target / blocks)
        .min(k / PIECE / kernels.constant("gemm_small_min_pieces").max(1))
        .min(kernels.constant("gemm_split_blocks") / slots)
        .max(1)
}

/// The dense small tiling's tiles of activation rows for m rows in its blocks of `cols` weight rows (256 or 128).
fn small_row_tiles(kernels: &Kernels, m: usize, cols: usize) -> usize {
    m.div_ceil(SmallKernel::of(kernels, m, cols).tile_rows(kernels))
}

/// Rows up to which a product may be split (a batched step's rows, a short prompt or a small chunk); longer
/// products keep the whole-k tiles.
const SPLIT_MAX_M: usize = 512;

/// Rounds of blocks over the SMs up to which a product takes the small tiling: its tiles of a few rows read every
/// weight once a tile, so a wide matrix of many row tiles is faster on the bf16 tiles (lm_head: on the H200 the small
/// tiling wins at 32 rows, 1,940 blocks in 8 rounds of 264, and loses at 64 rows, 3,880 blocks).
const SMALL_MAX_ROUNDS: usize = 8;

/// The plan of a `bits`-bit product of m rows, n weight rows (`col_blocks` blocks of 256) and `k_steps` steps of k. Up
/// to `gemm_small_max_rows` rows, 4-bit products whose k the small tiling takes go there unless their blocks take more
/// than `SMALL_MAX_ROUNDS` rounds over the SMs; in narrow blocks of 128 weight rows (`gemm_small_narrow`, in tall
/// tiles past one short tile of rows: [`SmallKernel`]) where the 256-row blocks would not fill every block slot of
/// the SMs once and the narrow ones cut k into as many parts or more. Up to `SPLIT_MAX_M` rows, while the 64-row
/// tiles take fewer than `gemm_split_tile_rounds` rounds over the SMs (1: fewer tiles than SMs), k is cut into as
/// many parts as fill `gemm_split_rounds` rounds of `gemm_split_blocks_per_sm` blocks an SM, each part at least
/// `gemm_split_min_steps` k steps, within the split products' slots; otherwise (or where that leaves one part)
/// whole-k tiles.
pub(crate) fn plan(kernels: &Kernels, bits: u32, m: usize, n: usize, k_steps: usize, sms: usize) -> Plan {
    let (k, col_blocks) = (k_steps * K_STEP, n.div_ceil(WEIGHT_ROWS));
    let small_blocks = col_blocks * small_row_tiles(kernels, m, WEIGHT_ROWS);
    let wide_slots = SmallKernel::Wide.blocks_per_sm(kernels) * sms;
    let small_rounds = small_blocks.div_ceil(wide_slots);
    if m <= kernels.constant("gemm_small_max_rows")
        && small_rounds <= SMALL_MAX_ROUNDS
        && small_fits(kernels, bits, m, k)
    {
        // Narrow blocks where the wide ones would leave block slots of the SMs empty (few warps on each SM), unless
        // they take longer parts of k (fewer parts for their more blocks).
        let wide = small_parts(kernels, m, n, WEIGHT_ROWS, k, sms);
        let narrow = small_parts(kernels, m, n, WEIGHT_ROWS / 2, k, sms);
        if kernels.constant("gemm_small_narrow") == 1 && small_blocks < wide_slots && narrow >= wide {
            return Plan::Small {
                parts: narrow,
                cols: WEIGHT_ROWS / 2,
            };
        }
        return Plan::Small {
            parts: wide,
            cols: WEIGHT_ROWS,
        };
    }
    let split_rows = kernels.constant("gemm_split_rows");
    let tiles = m.div_ceil(split_rows) * col_blocks;
    if m <= SPLIT_MAX_M && tiles < kernels.constant("gemm_split_tile_rounds") * sms {
        // On wgmma: 128-row tiles, one block an SM, as many parts as fill `gemm_split_rounds` rounds.
        if m > 64 && wgmma_fits(kernels, bits) && kernels.constant("gemm_wgmma_split") == 1 {
            let wide = m.div_ceil(2 * split_rows) * col_blocks;
            let parts = (kernels.constant("gemm_split_rounds") * sms / wide)
                .min(k_steps / kernels.constant("gemm_split_min_steps").max(1))
                .min(kernels.constant("gemm_split_blocks") / tiles);
            if parts >= 2 {
                return Plan::WgmmaSplit(parts);
            }
        }
        let target = kernels.constant("gemm_split_rounds") * kernels.constant("gemm_split_blocks_per_sm") * sms;
        let parts = (target / tiles)
            .min(k_steps / kernels.constant("gemm_split_min_steps").max(1))
            .min(kernels.constant("gemm_split_blocks") / tiles);
        if parts >= 2 {
            return Plan::Split(parts);
        }
    }
    let wide_cost = match wgmma_fits(kernels, bits) {
        true => kernels.constant("gemm_wgmma_cost") as f64 / 100.0,
        false => 1.0,
    };
    match tile_rows(m, col_blocks, sms, wide_cost) {
        128 if wgmma_fits(kernels, bits) => Plan::Wgmma(wgmma_cols(m, n, sms)),
        rows => Plan::Tiles(rows),
    }
}

/// The weight rows of a warpgroup tile for a product of m rows and n columns: 256 unless a narrower tile (192 or 128)
/// covers the SMs in rounds of blocks whose time (taken as proportional to the width, as a step's MMAs and
/// dequantization are) is under 0.9 of the 256-wide tiles'. A batched step's input projections, 49 x 2 blocks of 256 on
/// 132 SMs, leave a quarter of the SMs idle; 65 x 2 of 192 fill them.
fn wgmma_cols(m: usize, n: usize, sms: usize) -> usize {
    let time = |cols: usize| (m.div_ceil(128) * n.div_ceil(cols)).div_ceil(sms) * cols;
    let wide = time(256) as f64;
    [192, 128]
        .into_iter()
        .filter(|&c| (time(c) as f64) < 0.9 * wide)
        .min_by_key(|&c| time(c))
        .unwrap_or(256)
}

/// Whether the warpgroup kernel takes a `bits`-bit product: 4-bit, in a build for Hopper.
pub(crate) fn wgmma_fits(kernels: &Kernels, bits: u32) -> bool {
    bits == 4 && kernels.constant("gemm_wgmma") == 1
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
    gemm_coded(l, a, m, w, out, accumulate, false)
}

fn plan_for(l: &Launcher, m: usize, w: &GpuMatrix) -> Plan {
    plan(l.kernels, w.bits, m, w.rows, w.cols / K_STEP, l.gpu.sm_count)
}

/// Where a product of m rows by `w` reads its input as Q8x2 rows, if it takes the integer small tiling (the
/// kernels' own buffer): the kernel that produces the input may code it there (`rmsnorm_rows`), and
/// [`gemm_coded`] then runs the product without a coding launch of its own.
pub fn small_codes(l: &Launcher, m: usize, w: &GpuMatrix) -> Option<Q8x2> {
    matches!(plan_for(l, m, w), Plan::Small { .. }).then(|| Q8x2 {
        codes: l.kernels.buffer("gemm_small_codes"),
        pairs: l.kernels.buffer("gemm_small_pairs"),
    })
}

/// [`gemm`] of rows `a` that the kernel before coded into [`small_codes`] (`coded`; otherwise it is [`gemm`]).
pub fn gemm_coded(
    l: &mut Launcher,
    a: DevPtr<bf16>,
    m: usize,
    w: &GpuMatrix,
    out: DevPtr<f32>,
    accumulate: bool,
    coded: bool,
) -> Result<()> {
    match plan_for(l, m, w) {
        Plan::Small { parts, cols } if coded => gemm_small(l, a, m, w, out, accumulate, parts, cols, false, true),
        plan => {
            assert!(
                !coded,
                "rows coded for the small tiling, but the product of {m} rows takes {plan:?}"
            );
            gemm_planned(l, a, m, w, out, accumulate, plan)
        }
    }
}

/// [`gemm_coded`] with `accumulate`, except that where the plan cuts k into parts in the integer small tiling, the
/// parts stay in the split slots (`gemm_partials`) for the kernel that reads `out` next to add (`rmsnorm_rows`):
/// returns how many, or 0 where `out` holds the product.
pub fn gemm_coded_leaving_parts(
    l: &mut Launcher,
    a: DevPtr<bf16>,
    m: usize,
    w: &GpuMatrix,
    out: DevPtr<f32>,
    coded: bool,
) -> Result<usize> {
    match plan_for(l, m, w) {
        Plan::Small { parts, cols } if parts > 1 => {
            gemm_small(l, a, m, w, out, true, parts, cols, !coded, false)?;
            Ok(parts)
        }
        _ => gemm_coded(l, a, m, w, out, true, coded).map(|()| 0),
    }
}

pub(crate) fn gemm_planned(
    l: &mut Launcher,
    a: DevPtr<bf16>,
    m: usize,
    w: &GpuMatrix,
    out: DevPtr<f32>,
    accumulate: bool,
    plan: Plan,
) -> Result<()> {
    if let Plan::Small { parts, cols } = plan {
        return gemm_small(l, a, m, w, out, accumulate, parts, cols, true, true);
    }
    let (n, k) = (w.rows as i32, w.cols as i32);
    let dims = planned_dims(l, m, w.cols, w.rows, w.bits, plan);
    match (w.bits, plan) {
        (4, Plan::Tiles(64)) if l.kernels.constant("gemm_rows64_two") == 1 => {
            gemm::gemm_q4_rows64(l, dims, a, m as i32, w.q4(), n, k, out, accumulate as i32)
        }
        (4, Plan::Tiles(_)) => gemm::gemm_q4(l, dims, a, m as i32, w.q4(), n, k, out, accumulate as i32),
        (8, Plan::Tiles(_)) => gemm::gemm_q8(l, dims, a, m as i32, w.q4(), n, k, out, accumulate as i32),
        (4, Plan::Wgmma(_)) if tma_fits(l.kernels, a, w) && rs_fits(l.kernels, w, out) => {
            let [a_map, w_map, s_map, o_map] = rs_maps(l.gpu, a, m, w, out)?;
            let block = l.kernels.constant("gemm_wgmma_rs_threads") as u32;
            let grid = (w.rows.div_ceil(RS_COLS) as u32, m.div_ceil(RS_ROWS) as u32, 1);
            let dims = Dims::new(grid, block).shared(l.kernels.constant("gemm_wgmma_rs_smem") as u32);
            let acc = accumulate as i32;
            gemm::gemm_q4_wgmma_rs(l, dims, a_map, w_map, s_map, o_map, m as i32, n, k, acc)
        }
        (4, Plan::Wgmma(cols)) if tma_fits(l.kernels, a, w) => {
            let [a_map, w_map, s_map] = tma_maps(l.gpu, a, m, w, cols)?;
            let dims = dims.shared(l.kernels.constant("gemm_wgmma_tma_smem") as u32);
            let acc = accumulate as i32;
            match cols {
                WEIGHT_ROWS => gemm::gemm_q4_wgmma_tma(l, dims, a_map, w_map, s_map, m as i32, n, k, out, acc),
                _ => {
                    gemm::gemm_q4_wgmma_tma_narrow(l, dims, a_map, w_map, s_map, m as i32, n, k, out, acc, cols as i32)
                }
            }
        }
        (4, Plan::Wgmma(WEIGHT_ROWS)) => {
            gemm::gemm_q4_wgmma(l, dims, a, m as i32, w.q4(), n, k, out, accumulate as i32)
        }
        (4, Plan::Wgmma(cols)) => {
            let acc = accumulate as i32;
            gemm::gemm_q4_wgmma_narrow(l, dims, a, m as i32, w.q4(), n, k, out, acc, cols as i32)
        }
        (bits, Plan::Split(parts) | Plan::WgmmaSplit(parts)) => {
            let split = match (bits, plan) {
                (4, Plan::WgmmaSplit(_)) => gemm::gemm_q4_wgmma_split,
                (4, _) => gemm::gemm_q4_split,
                (8, Plan::Split(_)) => gemm::gemm_q8_split,
                _ => panic!("no {bits}-bit product as {plan:?}"),
            };
            split(l, dims, a, m as i32, w.q4(), n, k)?;
            let sum = sum_dims(m * w.rows.div_ceil(4));
            gemm::gemm_split_sum(l, sum, m as i32, n, parts as i32, out, accumulate as i32)
        }
        (bits, _) => panic!("no {bits}-bit product"),
    }
}

/// Whether a warpgroup product takes the tensor memory accelerator's copies (`gemm_q4_wgmma_tma`): where the build
/// says so (`gemm_wgmma_tma`), for a row-major matrix, with every start and row of the three tensors 16-byte aligned
/// as the tensor maps need (a row of pairs is 4 k / 64 bytes: k a multiple of 256, and at least that, since a
/// kernel with no step to copy would wait for one). Otherwise `gemm_q4_wgmma`.
fn tma_fits(kernels: &Kernels, a: DevPtr<bf16>, w: &GpuMatrix) -> bool {
    kernels.constant("gemm_wgmma_tma") == 1
        && w.layout == Layout::Rows
        && w.cols >= 4 * K_STEP
        && w.cols.is_multiple_of(4 * K_STEP)
        && [a.raw(), w.packed.ptr().raw(), w.scale_bias.ptr().raw()]
            .iter()
            .all(|p| p % 16 == 0)
}

/// A tile of `gemm_q4_wgmma_rs`: 256 activation rows by 128 weight rows.
const RS_ROWS: usize = 256;
const RS_COLS: usize = 128;

/// Whether a TMA product takes `gemm_q4_wgmma_rs` (the weights dequantized into registers): where the build says so
/// (`gemm_wgmma_rs`), with the output's rows (n f32) and start 16-byte aligned, as its tensor map needs.
fn rs_fits(kernels: &Kernels, w: &GpuMatrix, out: DevPtr<f32>) -> bool {
    kernels.constant("gemm_wgmma_rs") == 1 && w.rows.is_multiple_of(4) && out.raw().is_multiple_of(16)
}

/// The tensor maps of `gemm_q4_wgmma_rs`: [`tma_maps`]' codes and pairs in boxes of 128 weight rows, the activations
/// in boxes of 256 rows, and the output (f32 [m][n]) in boxes of 32 columns (128 bytes) by 256 rows with the
/// 128-byte swizzle the kernel writes its tile in.
fn rs_maps(gpu: &Gpu, a: DevPtr<bf16>, m: usize, w: &GpuMatrix, out: DevPtr<f32>) -> Result<[TensorMap; 4]> {
    use cudarc::driver::sys::{CUtensorMapDataType as Type, CUtensorMapSwizzle as Swizzle};
    let [a_map, w_map, s_map] = tma_maps_rows(gpu, a, m, RS_ROWS as u32, w, RS_COLS)?;
    let n = w.rows;
    let o_map = gpu.tensor_map_2d(
        out,
        Type::CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
        n,
        m,
        n * 4,
        32,
        RS_ROWS as u32,
        Swizzle::CU_TENSOR_MAP_SWIZZLE_128B,
    )?;
    Ok([a_map, w_map, s_map, o_map])
}

/// The tensor maps of `gemm_q4_wgmma_tma` for `a` (m rows) times `w` in tiles of `cols` weight rows: the activations
/// in boxes of one quantization group by 128 rows (the 128-byte swizzle wgmma reads), the packed codes in boxes of one
/// group (32 bytes) by `cols` rows, and the (scale, bias) pairs in boxes of four groups by `cols` rows.
fn tma_maps(gpu: &Gpu, a: DevPtr<bf16>, m: usize, w: &GpuMatrix, cols: usize) -> Result<[TensorMap; 3]> {
    tma_maps_rows(gpu, a, m, 128, w, cols)
}

/// [`tma_maps`] with the activations in boxes of `a_rows` rows.
fn tma_maps_rows(
    gpu: &Gpu,
    a: DevPtr<bf16>,
    m: usize,
    a_rows: u32,
    w: &GpuMatrix,
    cols: usize,
) -> Result<[TensorMap; 3]> {
    use cudarc::driver::sys::{CUtensorMapDataType as Type, CUtensorMapSwizzle as Swizzle};
    let (n, k, cols) = (w.rows, w.cols, cols as u32);
    let a_map = gpu.tensor_map_2d(
        a,
        Type::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        k,
        m,
        k * 2,
        K_STEP as u32,
        a_rows,
        Swizzle::CU_TENSOR_MAP_SWIZZLE_128B,
    )?;
    let w_map = gpu.tensor_map_2d(
        w.packed.ptr(),
        Type::CU_TENSOR_MAP_DATA_TYPE_UINT8,
        k / 2,
        n,
        k / 2,
        K_STEP as u32 / 2,
        cols,
        Swizzle::CU_TENSOR_MAP_SWIZZLE_NONE,
    )?;
    let s_map = gpu.tensor_map_2d(
        w.scale_bias.ptr(),
        Type::CU_TENSOR_MAP_DATA_TYPE_UINT32,
        k / K_STEP,
        n,
        k / K_STEP * 4,
        4,
        cols,
        Swizzle::CU_TENSOR_MAP_SWIZZLE_NONE,
    )?;
    Ok([a_map, w_map, s_map])
}

/// The small tiling's product: `a` coded as Q8x2 rows into the kernels' own buffer (unless `code` is false: a
/// kernel before did), then a block per (`cols` weight rows, tile of activation rows, part of k), and the parts'
/// sum where k is cut (unless `sum` is false: a kernel after adds them).
#[allow(clippy::too_many_arguments)]
fn gemm_small(
    l: &mut Launcher,
    a: DevPtr<bf16>,
    m: usize,
    w: &GpuMatrix,
    out: DevPtr<f32>,
    accumulate: bool,
    parts: usize,
    cols: usize,
    code: bool,
    sum: bool,
) -> Result<()> {
    let (n, k) = (w.rows, w.cols);
    assert!(
        cols == WEIGHT_ROWS || cols == WEIGHT_ROWS / 2,
        "small blocks of {cols} weight rows"
    );
    assert!(
        m >= 1 && small_fits(l.kernels, w.bits, m, k),
        "the small tiling takes no {}-bit product of {m} rows and k = {k}",
        w.bits
    );
    let col_blocks = n.div_ceil(WEIGHT_ROWS);
    let slots = col_blocks * m.div_ceil(l.kernels.constant("gemm_split_rows"));
    assert!(
        parts == 1 || (parts >= 2 && parts <= k / PIECE && slots * parts <= l.kernels.constant("gemm_split_blocks")),
        "{parts} parts of {} pieces in {slots} tiles",
        k / PIECE
    );
    if code {
        let words = m * k / 8;
        let quantize = Dims::linear(words.div_ceil(THREADS as usize) as u32, THREADS);
        gemm::gemm_quantize_rows(l, quantize, a, m as i32, k as i32)?;
    }
    let tiles = small_row_tiles(l.kernels, m, cols);
    let blocks = (n.div_ceil(cols) as u32, tiles as u32, parts as u32);
    let (acc, kernel) = (accumulate as i32, SmallKernel::of(l.kernels, m, cols));
    let dims = Dims::new(blocks, THREADS).shared(kernel.smem(l.kernels) as u32);
    let (m32, n32, k32) = (m as i32, n as i32, k as i32);
    match kernel {
        SmallKernel::Wide => gemm::gemm_q4_small(l, dims, m32, w.q4(), n32, k32, out, acc)?,
        SmallKernel::Narrow => gemm::gemm_q4_small_narrow(l, dims, m32, w.q4(), n32, k32, out, acc)?,
        SmallKernel::Tall => gemm::gemm_q4_small_tall(l, dims, m32, w.q4(), n32, k32, out, acc)?,
    }
    if parts > 1 && sum {
        let sum = sum_dims(m * n.div_ceil(4));
        gemm::gemm_split_sum(l, sum, m as i32, n as i32, parts as i32, out, acc)?;
    }
    Ok(())
}

/// Threads of the split products' sum kernels, one per 4 output columns of a row.
fn sum_dims(items: usize) -> Dims {
    Dims::linear(items.div_ceil(256) as u32, 256)
}

/// The geometry of a planned dense product: (column blocks, row blocks, parts of k) and its shared memory.
fn planned_dims(l: &Launcher, m: usize, k: usize, n: usize, bits: u32, plan: Plan) -> Dims {
    let col_blocks = n.div_ceil(WEIGHT_ROWS);
    let (rows, parts) = match plan {
        Plan::Wgmma(_) | Plan::WgmmaSplit(_) => {
            let (parts, cols) = match plan {
                Plan::WgmmaSplit(parts) => (parts, WEIGHT_ROWS),
                Plan::Wgmma(cols) => (1, cols),
                _ => unreachable!(),
            };
            let (x, y, _) = dense_grid(m, k, n.div_ceil(cols), 128);
            // The partial tiles are 64-row tiles in the split products' slots.
            let tiles = m.div_ceil(l.kernels.constant("gemm_split_rows")) * col_blocks;
            assert!(
                parts == 1 || (parts <= k / K_STEP && tiles * parts <= l.kernels.constant("gemm_split_blocks")),
                "{parts} parts of {} k steps in {tiles} tiles",
                k / K_STEP
            );
            return Dims::new((x, y, parts as u32), THREADS).shared(l.kernels.constant("gemm_wgmma_smem") as u32);
        }
        Plan::Tiles(rows) => (rows, 1),
        Plan::Split(parts) => (l.kernels.constant("gemm_split_rows"), parts),
        Plan::Small { .. } => unreachable!("the small tiling has its own geometry"),
    };
    let (x, y, _) = dense_grid(m, k, col_blocks, rows);
    if let Plan::Split(parts) = plan {
        let tiles = (x * y) as usize;
        assert!(
            parts >= 2 && parts <= k / K_STEP,
            "{parts} parts of {} k steps",
            k / K_STEP
        );
        assert!(
            tiles * parts <= l.kernels.constant("gemm_split_blocks"),
            "{tiles} tiles in {parts} parts exceed the split products' slots"
        );
    }
    Dims::new((x, y, parts as u32), THREADS).shared(shared_bytes(l.kernels, rows, bits))
}

/// Tokens up to which the grouped expert products take the small tiling (`moe_small_tile_rows` entries a tile, the
/// integer tensor cores; the kernels' `moe_small_max_tokens`). Longer prompts take the taller tilings of
/// [`moe_tile_rows`].
fn small_max_tokens(kernels: &Kernels) -> usize {
    kernels.constant("moe_small_max_tokens")
}

/// The tile height of the grouped expert products for a routing of `tokens` tokens (the sort's `tile_rows`): the
/// small tiling's up to `moe_small_max_tokens`; from `moe_rs_min_tokens` on `moe_gate_up_rs`'s where the build has
/// that kernel ([`moe_takes_rs`]); else from `moe_wgmma_min_tokens` on the warpgroup gate/up's where the build has
/// it (`moe_wgmma`); otherwise the mma.sync large tiling's.
pub fn moe_tile_rows(kernels: &Kernels, tokens: usize) -> usize {
    if tokens <= small_max_tokens(kernels) {
        kernels.constant("moe_small_tile_rows")
    } else if moe_takes_rs(kernels, tokens) {
        kernels.constant("moe_rs_tile_rows")
    } else if kernels.constant("moe_wgmma") == 1 && tokens >= kernels.constant("moe_wgmma_min_tokens") {
        kernels.constant("moe_wgmma_tile_rows")
    } else {
        kernels.constant("moe_tile_rows")
    }
}

/// Whether a routing of `tokens` tokens takes `moe_gate_up_rs` for its gate/up: from `moe_rs_min_tokens` tokens
/// where the build has it (`moe_rs`), past the small tiling.
pub fn moe_takes_rs(kernels: &Kernels, tokens: usize) -> bool {
    kernels.constant("moe_rs") == 1
        && tokens > small_max_tokens(kernels)
        && tokens >= kernels.constant("moe_rs_min_tokens")
}

/// Tiles of the grouped expert products for a routing of `tokens` tokens in tiles of `tile_rows`: each expert's
/// sorted entries in tiles of `tile_rows`, so at most one partial tile per expert, and never more tiles than
/// entries. The grouped products launch this many tile rows of blocks (those past the routing's tile count return
/// at once), so a launch for few tokens sizes it by those tokens, not by the scratch's capacity.
pub fn max_tiles(config: &Config, tokens: usize, tile_rows: usize) -> usize {
    let entries = tokens * moe_slots(config);
    (entries.div_ceil(tile_rows) + config.num_experts + 1).min(entries)
}

/// A token's entries in the grouped expert products: its routed experts, then the shared expert, which the sort
/// and the products take as expert number `num_experts` (its width is the routed experts'; `CudaModel::new`
/// checks).
pub fn moe_slots(config: &Config) -> usize {
    config.num_experts_per_tok + 1
}

/// The matrices of the grouped expert products: the routed experts' stacked gate, up and down, and the shared
/// expert's, which the products take as one more expert.
pub struct Experts<'a> {
    pub gate: &'a GpuMatrix,
    pub up: &'a GpuMatrix,
    pub down: &'a GpuMatrix,
    pub shared_gate: &'a GpuMatrix,
    pub shared_up: &'a GpuMatrix,
    pub shared_down: &'a GpuMatrix,
}

/// Tiles a scratch for routings of up to `tokens` tokens must hold: the most of any token count's tiling (a
/// tiling at its most tokens can make more tiles than the taller one just past it).
pub fn max_tiles_up_to(kernels: &Kernels, config: &Config, tokens: usize) -> usize {
    let small = tokens.min(small_max_tokens(kernels));
    // The most of each tiling's token counts: the largest count below the next tiling's start, and `tokens`.
    let before = |start: &'static str| tokens.min(kernels.constant(start).saturating_sub(1).max(small));
    let at = |t: usize| max_tiles(config, t, moe_tile_rows(kernels, t));
    at(small)
        .max(at(before("moe_wgmma_min_tokens")))
        .max(at(before("moe_rs_min_tokens")))
        .max(at(tokens))
}

/// The (token, slot) entries sorted by expert, as the grouped products read them: `entries` (i32, sorted index to
/// entry), `offsets` (i32 `[experts + 2]`, each expert's first sorted index, the shared expert's last, then the
/// end), `tiles` (i32 `[max_tiles][2]`: an expert and its tile's first sorted index), `tile_count` (i32: tiles in
/// use), the tile height the sort used (`moe_tile_rows` or `moe_small_tile_rows`), which picks the kernels, and
/// `work` (i32 `[1 + max_tiles]`, zeroed with the sort's counts: the small tiling's work counters).
pub struct Sorted {
    pub entries: DevPtr<i32>,
    pub tiles: DevPtr<i32>,
    pub tile_count: DevPtr<i32>,
    pub offsets: DevPtr<i32>,
    pub work: DevPtr<i32>,
    pub max_tiles: usize,
    pub tile_rows: usize,
    /// Tokens of the routing.
    pub tokens: usize,
    /// The entries a token has ([`moe_slots`]), which size the SwiGLU rows' tensor map.
    pub slots: usize,
    /// Whether the large tiling's gate/up runs on `moe_gate_up_rs` (tiles of `moe_rs_tile_rows`; see
    /// [`moe_takes_rs`]).
    pub rs: bool,
}

/// The small tiling's activations as Q8x2 rows (kernels/gemm.cu: two signed 8-bit digits an input, a (scale, sum)
/// pair a group of 64 inputs) for routings of up to `moe_small_max_tokens` tokens: the experts' input by token
/// (u32 `[tokens][hidden / 2]`, f32 `[tokens][hidden / 64][2]`) and the SwiGLU rows between the two products by
/// sorted entry (`[tokens * moe_slots][moe inter / 2]`, `[..][moe inter / 64][2]`).
pub struct SmallCodes {
    pub tokens: usize,
    pub x_codes: DevBuf<u32>,
    pub x_pairs: DevBuf<f32>,
    pub act_codes: DevBuf<u32>,
    pub act_pairs: DevBuf<f32>,
}

impl SmallCodes {
    /// Codes for routings of up to `tokens` tokens (at most the small tiling's).
    pub fn new(gpu: &Gpu, kernels: &Kernels, c: &Config, tokens: usize) -> Result<SmallCodes> {
        let tokens = tokens.min(small_max_tokens(kernels));
        let (h, inter, entries) = (c.hidden_size, c.moe_intermediate_size, tokens * moe_slots(c));
        Ok(SmallCodes {
            tokens,
            x_codes: gpu.alloc(tokens * h / 2)?,
            x_pairs: gpu.alloc(tokens * h / K_STEP * 2)?,
            act_codes: gpu.alloc(entries * inter / 2)?,
            act_pairs: gpu.alloc(entries * inter / K_STEP * 2)?,
        })
    }

    /// The experts' input rows.
    pub fn x(&self) -> Q8x2 {
        Q8x2 {
            codes: self.x_codes.ptr(),
            pairs: self.x_pairs.ptr(),
        }
    }
}

impl Sorted {
    /// Whether the tiles are the small tiling's.
    pub(crate) fn small(&self, kernels: &Kernels) -> bool {
        let small = kernels.constant("moe_small_tile_rows");
        assert!(
            self.tile_rows == small
                || self.tile_rows == kernels.constant("moe_tile_rows")
                || self.wgmma(kernels)
                || (self.rs && self.tile_rows == kernels.constant("moe_rs_tile_rows")),
            "no grouped product takes {}-row tiles",
            self.tile_rows
        );
        self.tile_rows == small
    }

    /// Whether the tiles are the warpgroup kernels' (a build for Hopper; the sort takes their height where
    /// `moe_wgmma` is 1, the selftest also where it is not).
    pub(crate) fn wgmma(&self, kernels: &Kernels) -> bool {
        !self.rs
            && kernels.constant("moe_wgmma_built") == 1
            && self.tile_rows == kernels.constant("moe_wgmma_tile_rows")
    }
}

/// The grouped expert products of the sorted entries `s`: `act[i][:] = silu(gate_e x[token]) * (up_e x[token])`
/// for every sorted entry i (token = entries[i] / moe_slots, e its expert, the shared one for e = experts), then
/// `out[entries[i]][:] = route_w[entries[i]] * (down_e act[i])`. `x` bf16 `[tokens][hidden]` (plus `x_lo`, what
/// rounding it to bf16 lost, which the small tiling adds; it may be null), `out` f32 `[tokens * moe_slots][hidden]`
/// and `route_w` f32 `[tokens * moe_slots]` by entry. The large tiling keeps act in `act` (bf16 `[tokens *
/// moe_slots][moe inter]` by sorted entry) and runs as a gate/up and a down launch of a block per (column block,
/// possible tile), those past `*tile_count` returning at once; the small one quantizes x into `codes`, keeps act
/// there and runs as one persistent launch of `moe_small_blocks_per_sm` blocks an SM (at most one per work item).
/// `x_coded`: the kernel that produced x coded it into `codes` already ([`SmallCodes::x`]), so the small tiling
/// does not.
#[allow(clippy::too_many_arguments)]
pub fn moe_experts(
    l: &mut Launcher,
    x: DevPtr<bf16>,
    x_lo: DevPtr<bf16>,
    s: &Sorted,
    route_w: DevPtr<f32>,
    m: &Experts,
    act: DevPtr<bf16>,
    codes: &SmallCodes,
    x_coded: bool,
    out: DevPtr<bf16>,
) -> Result<()> {
    let k = l.kernels;
    if s.small(k) {
        assert!(
            s.tokens <= codes.tokens,
            "the small tiling's codes hold {} tokens, not {}",
            codes.tokens,
            s.tokens
        );
        let x_codes = codes.x();
        if !x_coded {
            let words = s.tokens * m.shared_gate.cols / 8;
            let dims = Dims::linear(words.div_ceil(THREADS as usize) as u32, THREADS);
            gemm::moe_quantize_rows(l, dims, x, x_lo, s.tokens as i32, x_codes)?;
        }
        let items = s.max_tiles * k.constant("moe_small_items_per_tile");
        let blocks = items.min(k.constant("moe_small_blocks_per_sm") * l.gpu.sm_count);
        let dims = Dims::linear(blocks as u32, THREADS).shared(k.constant("moe_small_smem") as u32);
        let (gate, up, down) = (m.gate.tiled_q4(), m.up.tiled_q4(), m.down.tiled_q4());
        let (shared_gate, shared_up, shared_down) = (
            m.shared_gate.tiled_q4(),
            m.shared_up.tiled_q4(),
            m.shared_down.tiled_q4(),
        );
        return gemm::moe_small(
            l,
            dims,
            x_codes,
            s.entries,
            s.tiles,
            s.tile_count,
            s.offsets,
            route_w,
            gate,
            up,
            down,
            shared_gate,
            shared_up,
            shared_down,
            Q8x2 {
                codes: codes.act_codes.ptr(),
                pairs: codes.act_pairs.ptr(),
            },
            out,
            s.work,
        );
    }
    // Down runs on mma.sync in 64-row tiles, a taller tile (the warpgroup gate/up's) as parts of 64 rows, or, on
    // moe_gate_up_rs's tiles where the build has it, on moe_down_rs.
    let down_rows = k.constant("moe_tile_rows");
    let grid =
        |col_blocks: &'static str, parts: usize| (k.constant(col_blocks) as u32, s.max_tiles as u32, parts as u32);
    assert_eq!(s.tile_rows % down_rows, 0, "down takes whole parts of a tile");
    let (gate, up, shared_gate, shared_up) = (
        m.gate.tiled_q4(),
        m.up.tiled_q4(),
        m.shared_gate.tiled_q4(),
        m.shared_up.tiled_q4(),
    );
    if s.rs {
        assert!(
            k.constant("moe_rs") == 1 && s.tile_rows == k.constant("moe_rs_tile_rows"),
            "moe_gate_up_rs takes its own tiles"
        );
        let map = |w: &GpuMatrix| tiled_codes_map(l.gpu, w);
        let [gate_map, up_map, shared_gate_map, shared_up_map] =
            [map(m.gate)?, map(m.up)?, map(m.shared_gate)?, map(m.shared_up)?];
        let block = k.constant("gemm_wgmma_rs_threads") as u32;
        let dims = Dims::new(grid("moe_gate_up_col_blocks", 1), block).shared(k.constant("moe_rs_smem") as u32);
        gemm::moe_gate_up_rs(
            l,
            dims,
            gate_map,
            up_map,
            shared_gate_map,
            shared_up_map,
            x,
            s.entries,
            s.tiles,
            s.tile_count,
            s.offsets,
            gate,
            up,
            shared_gate,
            shared_up,
            act,
        )?;
    } else {
        let (gate_up, gate_up_shared): (GateUpLauncher, u32) = match s.wgmma(k) {
            true => (gemm::moe_gate_up_wgmma, k.constant("gemm_wgmma_smem") as u32),
            false => (gemm::moe_gate_up, shared_bytes(k, s.tile_rows, 4)),
        };
        gate_up(
            l,
            Dims::new(grid("moe_gate_up_col_blocks", 1), THREADS).shared(gate_up_shared),
            x,
            s.entries,
            s.tiles,
            s.tile_count,
            s.offsets,
            gate,
            up,
            shared_gate,
            shared_up,
            act,
        )?;
    }
    if s.rs && k.constant("moe_rs_down") == 1 {
        use cudarc::driver::sys::{CUtensorMapDataType as Type, CUtensorMapSwizzle as Swizzle};
        let act_map = |box_rows: usize| {
            l.gpu.tensor_map_2d(
                act,
                Type::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                m.down.cols,
                s.tokens * s.slots,
                m.down.cols * 2,
                K_STEP as u32,
                box_rows as u32,
                Swizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            )
        };
        let (act_map, act_box_map) = (act_map(s.tile_rows)?, act_map(k.constant("moe_down_rs_box_rows"))?);
        let (down_map, shared_down_map) = (tiled_codes_map(l.gpu, m.down)?, tiled_codes_map(l.gpu, m.shared_down)?);
        // Persistent: at most a block an SM (its shared memory allows no second), never more than the items.
        let items = s.max_tiles * k.constant("moe_down_rs_col_blocks");
        let blocks = items.min(l.gpu.sm_count) as u32;
        let threads = k.constant("gemm_wgmma_rs_threads") as u32;
        let dims = Dims::linear(blocks, threads).shared(k.constant("moe_down_rs_smem") as u32);
        return gemm::moe_down_rs(
            l,
            dims,
            act_map,
            act_box_map,
            down_map,
            shared_down_map,
            s.entries,
            s.tiles,
            s.tile_count,
            s.offsets,
            route_w,
            m.down.tiled_q4(),
            m.shared_down.tiled_q4(),
            out,
        );
    }
    gemm::moe_down(
        l,
        Dims::new(grid("moe_down_col_blocks", s.tile_rows / down_rows), THREADS).shared(shared_bytes(k, down_rows, 4)),
        act,
        s.entries,
        s.tiles,
        s.tile_count,
        s.offsets,
        route_w,
        m.down.tiled_q4(),
        m.shared_down.tiled_q4(),
        out,
    )
}

/// The tensor map of a tiled expert matrix's codes for `moe_gate_up_rs`: its bytes as rows of 64 (a row's piece of
/// 128 inputs, see kernels/common.cuh), read in boxes of 32 bytes (a step's half of a piece) by 128 rows (a block of
/// the tiled matrix's rows), unswizzled.
fn tiled_codes_map(gpu: &Gpu, w: &GpuMatrix) -> Result<TensorMap> {
    use cudarc::driver::sys::{CUtensorMapDataType as Type, CUtensorMapSwizzle as Swizzle};
    const PIECE_BYTES: usize = 64;
    assert!(
        w.bits == 4 && w.layout == Layout::Tiled,
        "the expert kernels read tiled 4-bit matrices"
    );
    let bytes = w.rows * w.cols / 2;
    gpu.tensor_map_2d(
        w.packed.ptr(),
        Type::CU_TENSOR_MAP_DATA_TYPE_UINT8,
        PIECE_BYTES,
        bytes / PIECE_BYTES,
        PIECE_BYTES,
        PIECE_BYTES as u32 / 2,
        128,
        Swizzle::CU_TENSOR_MAP_SWIZZLE_NONE,
    )
}

/// The large tiling's gate/up launchers (mma.sync and wgmma take the same arguments).
type GateUpLauncher = fn(
    &mut Launcher,
    Dims,
    DevPtr<bf16>,
    DevPtr<i32>,
    DevPtr<i32>,
    DevPtr<i32>,
    DevPtr<i32>,
    crate::kernels::Q4,
    crate::kernels::Q4,
    crate::kernels::Q4,
    crate::kernels::Q4,
    DevPtr<bf16>,
) -> Result<()>;

#[cfg(test)]
mod tests {
    use super::{max_tiles, max_tiles_up_to, moe_takes_rs, moe_tile_rows, wgmma_cols};
    use crate::kernels::Kernels;
    use lily_model::Config;

    /// The kernels' tiling constants, with `moe_gate_up_rs` on or off, its tile height and its and
    /// `moe_gate_up_wgmma`'s thresholds (the small tiling's tiles of 16 rows).
    fn tilings(rs: i32, rs_rows: i32, rs_min: i32, wgmma_min: i32) -> Kernels {
        tilings_small(16, rs, rs_rows, rs_min, wgmma_min)
    }

    fn tilings_small(small_rows: i32, rs: i32, rs_rows: i32, rs_min: i32, wgmma_min: i32) -> Kernels {
        Kernels::with_constants(&[
            ("moe_small_max_tokens", 512),
            ("moe_small_tile_rows", small_rows),
            ("moe_tile_rows", 64),
            ("moe_rs", rs),
            ("moe_rs_min_tokens", rs_min),
            ("moe_rs_tile_rows", rs_rows),
            ("moe_wgmma", 1),
            ("moe_wgmma_min_tokens", wgmma_min),
            ("moe_wgmma_tile_rows", 128),
        ])
    }

    #[test]
    fn the_scratch_holds_the_tiles_of_every_routing_up_to_its_chunk() {
        let config = Config::full_shape();
        // As built, without moe_gate_up_rs, with its threshold past moe_gate_up_wgmma's, and with taller small
        // tiles (then the 64-row tiles just below moe_gate_up_rs's threshold make the most tiles up to it).
        let built = [
            (16, 1, 128, 2048, 8192),
            (16, 0, 128, 2048, 8192),
            (16, 1, 64, 8192, 4096),
        ];
        for (small_rows, rs, rs_rows, rs_min, wgmma_min) in built.into_iter().chain([(32, 1, 128, 2048, 8192)]) {
            let k = tilings_small(small_rows, rs, rs_rows, rs_min, wgmma_min);
            for chunk in [300, 2048, 5000, 16384] {
                let room = max_tiles_up_to(&k, &config, chunk);
                for t in 1..=chunk {
                    let tiles = max_tiles(&config, t, moe_tile_rows(&k, t));
                    assert!(
                        tiles <= room,
                        "{t} tokens make {tiles} tiles, the scratch of {chunk} holds {room}"
                    );
                }
            }
        }
    }

    #[test]
    fn routings_take_moe_gate_up_rs_from_its_threshold_in_its_tiles() {
        let k = tilings(1, 128, 2048, 8192);
        assert!(!moe_takes_rs(&k, 2047) && moe_tile_rows(&k, 2047) == 64);
        assert!(moe_takes_rs(&k, 2048) && moe_tile_rows(&k, 2048) == 128);
        assert!(moe_takes_rs(&k, 16384) && moe_tile_rows(&k, 16384) == 128);
        assert!(!moe_takes_rs(&k, 512) && moe_tile_rows(&k, 512) == 16);
        // Without it, the warpgroup tiles from their own threshold.
        let k = tilings(0, 128, 2048, 8192);
        assert!(!moe_takes_rs(&k, 4096) && moe_tile_rows(&k, 4096) == 64);
        assert!(!moe_takes_rs(&k, 8192) && moe_tile_rows(&k, 8192) == 128);
        // A threshold inside the small tiling's range does not take its routings.
        let k = tilings(1, 128, 100, 8192);
        assert!(!moe_takes_rs(&k, 300) && moe_tile_rows(&k, 300) == 16);
    }

    #[test]
    fn warpgroup_tiles_narrow_only_where_they_fill_more_sms() {
        let sms = 132;
        // A 256-row step: the DeltaNet input projections (12,352 columns) and attention's (9,216) have 98 and 72
        // blocks of 256; 130 and 96 blocks of 192 take one round at three quarters of the width.
        assert_eq!(wgmma_cols(256, 12_352, sms), 192);
        assert_eq!(wgmma_cols(256, 9_216, sms), 192);
        // 128 rows: 97 blocks of 128 fit in one round.
        assert_eq!(wgmma_cols(128, 12_352, sms), 128);
        // A long prompt and lm_head take as many rounds of narrower blocks: 256 stays.
        assert_eq!(wgmma_cols(4_096, 12_352, sms), 256);
        assert_eq!(wgmma_cols(256, 248_320, sms), 256);
        // Many rounds already: 256 stays unless a narrower width saves a tenth.
        assert_eq!(wgmma_cols(16_384, 2_048, sms), 256);
    }
}
