//! The prefill's glue (kernels/prefill.cu): embedding rows, RMSNorm rows into bf16, the router's logits, the
//! routing and the stable sort of (token, slot) entries by expert, and the MoE combine into the residual stream.

use half::bf16;

use super::signature::launchers;
use super::{KernelFile, Q8x2, Q4};
use crate::driver::DevPtr;

pub const FILE: KernelFile<'static> = KernelFile {
    name: "prefill.cu",
    source: include_str!("../../kernels/prefill.cu"),
    kernels: KERNELS,
    buffers: &[],
    constants: &[
        "router_strip_rows",
        "router_tile_tokens",
        "router_threads",
        "router_tall_strips",
        "router_tall_min_tokens",
        "router_wide_min_tokens",
        "router_wide_strips",
        "router_wide_tokens",
        "router_wide_threads",
        "router_wide_smem",
        "route_sort_max_tokens",
        "route_sort_threads",
        "sort_masks_min_tokens",
    ],
};

launchers! {
    /// `hidden[r] = embed_tokens[tokens[start + r]]`, dequantized.
    embed_rows(tokens: DevPtr<i32>, start: i32, table: Q4, hidden: DevPtr<f32>);
    /// `out[r] = bf16(rmsnorm(hidden[r]) * norm)`, and what that rounding lost into `out_lo` unless it is null;
    /// unless `expert_out` is null, the MoE rows that `moe_combine` would add are added to `hidden` first; unless
    /// `parts` is 0, the parts of k that the product before left at `partials` (the split slots) are added to
    /// `hidden` first, as `gemm_split_sum` would add them; unless `codes` is [`Q8x2::NONE`], `out` (+ `out_lo`) also
    /// coded as the small tiling's Q8x2 rows.
    rmsnorm_rows(
        hidden: DevPtr<f32>,
        expert_out: DevPtr<bf16>,
        partials: DevPtr<f32>,
        parts: i32,
        norm: DevPtr<f32>,
        out: DevPtr<bf16>,
        out_lo: DevPtr<bf16>,
        codes: Q8x2,
    );
    /// `logits[t][e] = router[e] . (x_hi[t] + x_lo[t])` with f32 sums for the experts' and the shared gate's rows,
    /// `t < m`; grid (strips of `router_strip_rows` rows, tiles of `router_tile_tokens` tokens), `router_threads`
    /// threads a block.
    router_rows(x_hi: DevPtr<bf16>, x_lo: DevPtr<bf16>, m: i32, router: Q4, logits: DevPtr<f32>);
    /// `router_rows` with `router_tall_strips` strips a block (grid x: groups of that many strips): the same bits,
    /// each tile's inputs fetched once per group of strips, for long prompts.
    router_rows_tall(x_hi: DevPtr<bf16>, x_lo: DevPtr<bf16>, m: i32, router: Q4, logits: DevPtr<f32>);
    /// `router_rows` again, for a prompt's chunk of thousands of tokens: grid (groups of `router_wide_strips`
    /// strips, tiles of `router_wide_tokens` tokens), `router_wide_threads` threads and `router_wide_smem` bytes of
    /// shared memory a block, each group of 64 inputs staged once for all of a block's strips and tokens.
    router_rows_wide(x_hi: DevPtr<bf16>, x_lo: DevPtr<bf16>, m: i32, router: Q4, logits: DevPtr<f32>);
    /// Each token's top-k experts and weights, then the shared expert (number `experts`) and its gate, the count
    /// of entries per expert, and each routed expert's tokens as bits (`mask_words` words an expert; the counts
    /// and masks zeroed before).
    route_rows(
        logits: DevPtr<f32>,
        t: i32,
        route_ids: DevPtr<i32>,
        route_w: DevPtr<f32>,
        counts: DevPtr<i32>,
        masks: DevPtr<u32>,
        mask_words: i32,
    );
    /// The entries stably sorted by expert, each expert's offset, and the tiles of `tile_rows` entries.
    moe_sort(
        route_ids: DevPtr<i32>,
        t: i32,
        counts: DevPtr<i32>,
        masks: DevPtr<u32>,
        mask_words: i32,
        tile_rows: i32,
        offsets: DevPtr<i32>,
        entries: DevPtr<i32>,
        tiles: DevPtr<i32>,
        tile_count: DevPtr<i32>,
    );
    /// For at most `route_sort_max_tokens` tokens, in one block: `route_rows` after the counts are cleared (and the
    /// `work_len` work counters after them), then `moe_sort`, with their results.
    moe_route_sort(
        logits: DevPtr<f32>,
        t: i32,
        tile_rows: i32,
        route_ids: DevPtr<i32>,
        route_w: DevPtr<f32>,
        counts: DevPtr<i32>,
        work_len: i32,
        offsets: DevPtr<i32>,
        entries: DevPtr<i32>,
        tiles: DevPtr<i32>,
        tile_count: DevPtr<i32>,
    );
    /// `hidden[r] +=` the sum of row r's weighted expert outputs (the shared expert's last).
    moe_combine(hidden: DevPtr<f32>, expert_out: DevPtr<bf16>);
}
