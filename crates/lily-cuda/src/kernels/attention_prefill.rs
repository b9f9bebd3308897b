//! The prefill's gated full attention (kernels/attention_prefill.cu): q/k norms, RoPE and the paged KV write;
//! causal flash attention on tensor cores; the merge of split key ranges with the output gate.

use half::bf16;

use super::signature::launchers;
use super::KernelFile;
use crate::driver::DevPtr;

pub const FILE: KernelFile<'static> = KernelFile {
    name: "attention_prefill.cu",
    source: concat!(
        include_str!("../../kernels/attention_tiles.cuh"),
        include_str!("../../kernels/attention_prefill.cu")
    ),
    kernels: KERNELS,
    buffers: &[],
    constants: &[
        "attn_prefill_wgmma_built",
        "attn_prefill_wgmma_smem",
        "attn_prefill_i8_built",
        "attn_prefill_i8_default",
        "attn_prefill_i8_smem",
        "attn_prefill_i8_v8",
        "attn_prefill_i8_v8_row",
    ],
};

launchers! {
    /// Normed, rotated, scaled queries into `q_out`; the tokens' keys and values into the pools through `pages`
    /// (one sequence's page-table row).
    attn_prefill_prep(
        proj: DevPtr<f32>,
        q_norm: DevPtr<f32>,
        k_norm: DevPtr<f32>,
        inv_freq: DevPtr<f32>,
        tokens: i32,
        start: i32,
        q_out: DevPtr<bf16>,
        k_pool: DevPtr<bf16>,
        v_pool: DevPtr<bf16>,
        pages: DevPtr<i32>,
    );
    /// Causal attention over key chunks of `chunk` keys: gated output into `out` (one chunk) or parts.
    attn_prefill(
        q: DevPtr<bf16>,
        k_pool: DevPtr<bf16>,
        v_pool: DevPtr<bf16>,
        pages: DevPtr<i32>,
        proj: DevPtr<f32>,
        tokens: i32,
        start: i32,
        chunk: i32,
        out: DevPtr<bf16>,
        part_o: DevPtr<f32>,
        part_ml: DevPtr<f32>,
    );
    /// `attn_prefill` on the warpgroup tensor cores (sm_90a builds, unless ATTN_PREFILL_WGMMA=0): the same grid,
    /// arguments and outputs, `attn_prefill_wgmma_smem` bytes of shared memory a block.
    attn_prefill_wgmma(
        q: DevPtr<bf16>,
        k_pool: DevPtr<bf16>,
        v_pool: DevPtr<bf16>,
        pages: DevPtr<i32>,
        proj: DevPtr<f32>,
        tokens: i32,
        start: i32,
        chunk: i32,
        out: DevPtr<bf16>,
        part_o: DevPtr<f32>,
        part_ml: DevPtr<f32>,
    );
    /// The mean of up to 256 keys spread over the context, per KV head, into `mean` (f32 `[kv heads][head_dim]`);
    /// unless null, `v_max` (f32 `[kv heads]`) cleared for `attn_prefill_v_max`.
    attn_prefill_key_mean(
        k_pool: DevPtr<bf16>,
        pages: DevPtr<i32>,
        tokens: i32,
        start: i32,
        mean: DevPtr<f32>,
        v_max: DevPtr<f32>,
    );
    /// 8-bit codes with a scale per row of the call's queries and of every key up to its last position (less
    /// `mean`), for `attn_prefill_i8`.
    attn_prefill_codes(
        q: DevPtr<bf16>,
        k_pool: DevPtr<bf16>,
        pages: DevPtr<i32>,
        mean: DevPtr<f32>,
        tokens: i32,
        start: i32,
        scale_stride: i32,
        q8: DevPtr<i8>,
        q_scale: DevPtr<f32>,
        k8: DevPtr<i8>,
        k_scale: DevPtr<f32>,
    );
    /// With ATTN_I8_V8_ROW: each KV head's largest value magnitude over positions `0 .. positions` into `v_max`
    /// (f32 `[kv heads]`, cleared by `attn_prefill_key_mean`).
    attn_prefill_v_max(v_pool: DevPtr<bf16>, pages: DevPtr<i32>, positions: i32, v_max: DevPtr<f32>);
    /// With ATTN_I8_V8: the values of positions `0 .. positions` as e4m3 codes, transposed per block of 64
    /// positions, and one scale per (KV head, block), for `attn_prefill_i8`; unless `v_max` is null, every block of
    /// a head with the head's scale.
    attn_prefill_v_codes(
        v_pool: DevPtr<bf16>,
        pages: DevPtr<i32>,
        positions: i32,
        scale_stride: i32,
        v_max: DevPtr<f32>,
        v8: DevPtr<u8>,
        v_scale: DevPtr<f32>,
    );
    /// `attn_prefill_wgmma` with the scores from the 8-bit codes on the integer tensor cores (sm_90a builds):
    /// the same grid and outputs, `attn_prefill_i8_smem` bytes of shared memory a block.
    attn_prefill_i8(
        q8: DevPtr<i8>,
        q_scale: DevPtr<f32>,
        k8: DevPtr<i8>,
        k_scale: DevPtr<f32>,
        scale_stride: i32,
        v8: DevPtr<u8>,
        v_scale: DevPtr<f32>,
        v_pool: DevPtr<bf16>,
        pages: DevPtr<i32>,
        proj: DevPtr<f32>,
        tokens: i32,
        start: i32,
        chunk: i32,
        out: DevPtr<bf16>,
        part_o: DevPtr<f32>,
        part_ml: DevPtr<f32>,
    );
    /// The parts merged and gated into `out`.
    attn_prefill_merge(
        part_o: DevPtr<f32>,
        part_ml: DevPtr<f32>,
        proj: DevPtr<f32>,
        tokens: i32,
        start: i32,
        chunk: i32,
        out: DevPtr<bf16>,
    );
}
