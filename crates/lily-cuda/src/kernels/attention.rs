//! The decode step's gated full attention (kernels/attention.cu), for a batch of rows each in its own sequence
//! slot: q/k norms, RoPE and the write into the paged KV pools; the context split into parts, each attended
//! separately (on CUDA cores for one sequence, on the tensor cores for a batched step); the parts merged and gated.

use half::bf16;

use super::signature::launchers;
use super::{KernelFile, Q8x2};
use crate::driver::DevPtr;

pub const FILE: KernelFile<'static> = KernelFile {
    name: "attention.cu",
    source: concat!(
        include_str!("../../kernels/attention_tiles.cuh"),
        include_str!("../../kernels/attention.cu")
    ),
    kernels: KERNELS,
    buffers: &[],
    constants: &[
        "attn_rows_smem",
        "attn_rows_blocks_per_sm",
        "attn_merge_rows_max_splits",
    ],
};

launchers! {
    /// Normed, rotated queries into `q_out` (row b at b * q_dim); each row's key and value into the pools at its
    /// position through its slot's page-table row. Grid (heads + kv heads, 1, rows).
    attn_prep(
        positions: DevPtr<i32>,
        slots: DevPtr<i32>,
        proj: DevPtr<f32>,
        q_norm: DevPtr<f32>,
        k_norm: DevPtr<f32>,
        inv_freq: DevPtr<f32>,
        q_out: DevPtr<f32>,
        k_pool: DevPtr<bf16>,
        v_pool: DevPtr<bf16>,
        page_table: DevPtr<i32>,
        pages_per_seq: i32,
    );
    /// One part of a row's context per block: its unnormalised output, row max and sum. Grid (kv heads, splits,
    /// rows), splits <= ATTN_SPLITS.
    attn_partial(
        positions: DevPtr<i32>,
        slots: DevPtr<i32>,
        q: DevPtr<f32>,
        k_pool: DevPtr<bf16>,
        v_pool: DevPtr<bf16>,
        page_table: DevPtr<i32>,
        pages_per_seq: i32,
        splits: i32,
        part_o: DevPtr<f32>,
        part_ml: DevPtr<f32>,
    );
    /// `attn_partial` on the tensor cores, for a batched step: the same grid, parts and outputs; 128 threads and
    /// `attn_rows_smem` bytes of dynamic shared memory a block.
    attn_partial_rows(
        positions: DevPtr<i32>,
        slots: DevPtr<i32>,
        q: DevPtr<f32>,
        k_pool: DevPtr<bf16>,
        v_pool: DevPtr<bf16>,
        page_table: DevPtr<i32>,
        pages_per_seq: i32,
        splits: i32,
        part_o: DevPtr<f32>,
        part_ml: DevPtr<f32>,
    );
    /// The `splits` parts merged, times sigmoid of the output gate (in `proj`), into `attn` (f32) and
    /// `attn_bf16`, each when not null. Grid (heads, head_dim / 32, rows).
    attn_merge(
        positions: DevPtr<i32>,
        splits: i32,
        part_o: DevPtr<f32>,
        part_ml: DevPtr<f32>,
        proj: DevPtr<f32>,
        attn: DevPtr<f32>,
        attn_bf16: DevPtr<bf16>,
    );
    /// `attn_merge` into bf16 for `rows` rows of at most `attn_merge_rows_max_splits` parts, a warp per (row, query
    /// head, 32 dimensions); unless `codes` is [`Q8x2::NONE`], the rows also coded as the small tiling's Q8x2 rows.
    attn_merge_rows(
        positions: DevPtr<i32>,
        rows: i32,
        splits: i32,
        part_o: DevPtr<f32>,
        part_ml: DevPtr<f32>,
        proj: DevPtr<f32>,
        attn_bf16: DevPtr<bf16>,
        codes: Q8x2,
    );
}
