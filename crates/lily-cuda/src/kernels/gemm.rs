//! The prefill's tensor-core matrix products (kernels/gemm.cu): dense 4- and 8-bit products, the shared expert's
//! gate/up pair with SwiGLU, and the routed experts' grouped products over entries sorted by expert.

use half::bf16;

use super::signature::launchers;
use super::{KernelFile, Q8x2, TensorMap, Q4};
use crate::driver::DevPtr;

pub const FILE: KernelFile<'static> = KernelFile {
    name: "gemm.cu",
    source: include_str!("../../kernels/gemm.cu"),
    kernels: KERNELS,
    buffers: &["gemm_small_codes", "gemm_small_pairs", "gemm_partials"],
    constants: &[
        "moe_tile_rows",
        "gemm_stages",
        "moe_gate_up_col_blocks",
        "moe_down_col_blocks",
        "gemm_split_blocks",
        "gemm_split_blocks_per_sm",
        "gemm_split_min_steps",
        "gemm_split_tile_rounds",
        "gemm_split_rounds",
        "gemm_split_rows",
        "moe_small_tile_rows",
        "moe_small_max_tokens",
        "moe_small_smem",
        "moe_small_blocks_per_sm",
        "moe_small_items_per_tile",
        "gemm_small_max_rows",
        "gemm_small_rows_cap",
        "gemm_small_max_k",
        "gemm_small_min_pieces",
        "gemm_small_narrow",
        "gemm_small_blocks_per_sm",
        "gemm_small_smem",
        "gemm_small_narrow_smem",
        "gemm_small_narrow_blocks_per_sm",
        "gemm_small_tall",
        "gemm_small_tall_rows",
        "gemm_small_tall_smem",
        "gemm_small_tall_blocks_per_sm",
        "gemm_wgmma",
        "gemm_wgmma_smem",
        "gemm_wgmma_tma_smem",
        "gemm_wgmma_tma",
        "gemm_wgmma_rs",
        "gemm_wgmma_rs_smem",
        "gemm_wgmma_rs_threads",
        "gemm_wgmma_cost",
        "gemm_wgmma_split",
        "moe_wgmma",
        "moe_wgmma_built",
        "moe_wgmma_tile_rows",
        "moe_wgmma_min_tokens",
        "moe_rs",
        "moe_rs_smem",
        "moe_rs_tile_rows",
        "moe_rs_min_tokens",
        "moe_rs_down",
        "moe_rs_narrow",
        "moe_down_rs_smem",
        "moe_down_rs_col_blocks",
        "moe_down_rs_box_rows",
        "gemm_rows64_two",
    ],
};

launchers! {
    /// `out[m][n] = a[m][k] w[n][k]^T` (`+=` where `accumulate` is 1), 4-bit weights.
    gemm_q4(a: DevPtr<bf16>, m: i32, w: Q4, n: i32, k: i32, out: DevPtr<f32>, accumulate: i32);
    /// `gemm_q4` in 128-row tiles of 256 weight rows on the warpgroup tensor cores (Hopper builds only:
    /// `gemm_wgmma` is 1).
    gemm_q4_wgmma(a: DevPtr<bf16>, m: i32, w: Q4, n: i32, k: i32, out: DevPtr<f32>, accumulate: i32);
    /// `gemm_q4_wgmma` in tiles of `cols` (192 or 128) weight rows: more blocks for products with few.
    gemm_q4_wgmma_narrow(
        a: DevPtr<bf16>,
        m: i32,
        w: Q4,
        n: i32,
        k: i32,
        out: DevPtr<f32>,
        accumulate: i32,
        cols: i32,
    );
    /// `gemm_q4_wgmma` with its operands brought by the tensor memory accelerator: `a_map` over `a` (bf16 [m][k],
    /// boxes of 64 x 128 rows, 128-byte swizzle), `w_map` over the packed codes (bytes [n][k / 2], boxes of 32 x 256
    /// rows), `s_map` over the (scale, bias) pairs (u32 [n][k / 64], boxes of 4 x 256 rows); see `tma_maps`.
    gemm_q4_wgmma_tma(
        a_map: TensorMap,
        w_map: TensorMap,
        s_map: TensorMap,
        m: i32,
        n: i32,
        k: i32,
        out: DevPtr<f32>,
        accumulate: i32,
    );
    /// `gemm_q4_wgmma_tma`'s product with the weights dequantized into registers as wgmma's A operand
    /// (`gemm_wgmma_rs_threads` threads, `gemm_wgmma_rs_smem` bytes of shared memory a block), a block 256 activation
    /// rows by 128 weight rows: `a_map` in boxes of 64 x 256 rows, `w_map` and `s_map` of 128 rows; the product goes
    /// out through `o_map` (f32 [m][n], boxes of 32 x 256 rows, 128-byte swizzle), added to what is there where
    /// `accumulate` is 1.
    gemm_q4_wgmma_rs(
        a_map: TensorMap,
        w_map: TensorMap,
        s_map: TensorMap,
        o_map: TensorMap,
        m: i32,
        n: i32,
        k: i32,
        accumulate: i32,
    );
    /// `gemm_q4_wgmma_tma` in tiles of `cols` (192 or 128) weight rows, whose maps' weight boxes are `cols` rows.
    gemm_q4_wgmma_tma_narrow(
        a_map: TensorMap,
        w_map: TensorMap,
        s_map: TensorMap,
        m: i32,
        n: i32,
        k: i32,
        out: DevPtr<f32>,
        accumulate: i32,
        cols: i32,
    );
    /// The same with 8-bit weights.
    gemm_q8(a: DevPtr<bf16>, m: i32, w: Q4, n: i32, k: i32, out: DevPtr<f32>, accumulate: i32);
    /// `gemm_q4` in 64-row tiles at two blocks an SM (where `gemm_rows64_two` is 1).
    gemm_q4_rows64(a: DevPtr<bf16>, m: i32, w: Q4, n: i32, k: i32, out: DevPtr<f32>, accumulate: i32);
    /// `gemm_q4`'s partial products over `gridDim.z` parts of k, into the split products' slots (few rows).
    gemm_q4_split(a: DevPtr<bf16>, m: i32, w: Q4, n: i32, k: i32);
    /// `gemm_q4_split` in 128-row tiles on the warpgroup tensor cores (Hopper builds only).
    gemm_q4_wgmma_split(a: DevPtr<bf16>, m: i32, w: Q4, n: i32, k: i32);
    /// The same with 8-bit weights.
    gemm_q8_split(a: DevPtr<bf16>, m: i32, w: Q4, n: i32, k: i32);
    /// `out[m][n]` (`+=` where `accumulate` is 1) = the sum in order of the `parts` partial products of a split
    /// product.
    gemm_split_sum(m: i32, n: i32, parts: i32, out: DevPtr<f32>, accumulate: i32);
    /// The large tiling's gate/up products with SwiGLU (the shared expert's too), one tile of sorted entries per
    /// block row.
    moe_gate_up(
        x: DevPtr<bf16>,
        entries: DevPtr<i32>,
        tiles: DevPtr<i32>,
        tile_count: DevPtr<i32>,
        offsets: DevPtr<i32>,
        gate: Q4,
        up: Q4,
        shared_gate: Q4,
        shared_up: Q4,
        act: DevPtr<bf16>,
    );
    /// The large tiling's down products (the shared expert's too), scaled by the routing weights, by entry.
    moe_down(
        act: DevPtr<bf16>,
        entries: DevPtr<i32>,
        tiles: DevPtr<i32>,
        tile_count: DevPtr<i32>,
        offsets: DevPtr<i32>,
        route_w: DevPtr<f32>,
        down: Q4,
        shared_down: Q4,
        out: DevPtr<bf16>,
    );
    /// `moe_gate_up` in 128-row tiles on the warpgroup tensor cores (Hopper builds only: `moe_wgmma` is 1).
    moe_gate_up_wgmma(
        x: DevPtr<bf16>,
        entries: DevPtr<i32>,
        tiles: DevPtr<i32>,
        tile_count: DevPtr<i32>,
        offsets: DevPtr<i32>,
        gate: Q4,
        up: Q4,
        shared_gate: Q4,
        shared_up: Q4,
        act: DevPtr<bf16>,
    );
    /// `moe_gate_up_wgmma`'s product with the weights dequantized into registers as wgmma's A operand
    /// (`gemm_wgmma_rs_threads` threads, `moe_rs_smem` bytes of shared memory a block; Hopper builds only: `moe_rs` is
    /// 1), on tiles of `moe_rs_tile_rows`. The maps are the tiled codes of gate, up and the shared expert's gate and
    /// up as rows of 64 bytes, in boxes of 32 bytes by 128 rows (`gemm::tiled_codes_map`).
    moe_gate_up_rs(
        gate_map: TensorMap,
        up_map: TensorMap,
        shared_gate_map: TensorMap,
        shared_up_map: TensorMap,
        x: DevPtr<bf16>,
        entries: DevPtr<i32>,
        tiles: DevPtr<i32>,
        tile_count: DevPtr<i32>,
        offsets: DevPtr<i32>,
        gate: Q4,
        up: Q4,
        shared_gate: Q4,
        shared_up: Q4,
        act: DevPtr<bf16>,
    );
    /// `moe_down`'s product on `moe_gate_up_rs`'s tiles with the weights dequantized into registers as wgmma's A
    /// operand (`gemm_wgmma_rs_threads` threads, `moe_down_rs_smem` bytes of shared memory a block; Hopper builds
    /// only, where `moe_rs_down` is 1): a persistent launch of at most one block an SM walking the (tile, column
    /// block of 128 hidden rows) items. `act_map` is over `act` (bf16 `[tokens * moe_slots][moe inter]`, boxes of 64
    /// inputs by `moe_rs_tile_rows` rows, 128-byte swizzle), and `act_box_map` the same in boxes of
    /// `moe_down_rs_box_rows` rows (for the tiles whose MMAs run on fewer rows); the others are the tiled codes of
    /// down and the shared expert's down as rows of 64 bytes, in boxes of 32 bytes by 128 rows
    /// (`gemm::tiled_codes_map`).
    moe_down_rs(
        act_map: TensorMap,
        act_box_map: TensorMap,
        down_map: TensorMap,
        shared_down_map: TensorMap,
        entries: DevPtr<i32>,
        tiles: DevPtr<i32>,
        tile_count: DevPtr<i32>,
        offsets: DevPtr<i32>,
        route_w: DevPtr<f32>,
        down: Q4,
        shared_down: Q4,
        out: DevPtr<bf16>,
    );
    /// The small tiling's input: `rows` rows of `hi + lo` (`lo` may be null) as Q8x2 codes and group pairs.
    moe_quantize_rows(hi: DevPtr<bf16>, lo: DevPtr<bf16>, rows: i32, out: Q8x2);
    /// The small tiling's gate/up and down in one persistent launch on the integer tensor cores (`work`: the item
    /// counter, then each tile's finished gate/up items, zeroed before).
    moe_small(
        x: Q8x2,
        entries: DevPtr<i32>,
        tiles: DevPtr<i32>,
        tile_count: DevPtr<i32>,
        offsets: DevPtr<i32>,
        route_w: DevPtr<f32>,
        gate: Q4,
        up: Q4,
        down: Q4,
        shared_gate: Q4,
        shared_up: Q4,
        shared_down: Q4,
        act: Q8x2,
        out: DevPtr<bf16>,
        work: DevPtr<i32>,
    );
    /// The small tiling's dense input: `m` rows of `k` inputs of `a` as Q8x2 rows, into the kernels' own buffer.
    gemm_quantize_rows(a: DevPtr<bf16>, m: i32, k: i32);
    /// `out[m][n] = a[m][k] w[n][k]^T` (`+=` where `accumulate` is 1) on the integer tensor cores, for the rows
    /// `gemm_quantize_rows` coded; with `gridDim.z` parts of k, the parts into the split products' slots instead.
    gemm_q4_small(m: i32, w: Q4, n: i32, k: i32, out: DevPtr<f32>, accumulate: i32);
    /// `gemm_q4_small` in narrow blocks of 128 weight rows, more of them an SM.
    gemm_q4_small_narrow(m: i32, w: Q4, n: i32, k: i32, out: DevPtr<f32>, accumulate: i32);
    /// `gemm_q4_small_narrow` in taller tiles of activation rows (`gemm_small_tall_rows`).
    gemm_q4_small_tall(m: i32, w: Q4, n: i32, k: i32, out: DevPtr<f32>, accumulate: i32);
}
