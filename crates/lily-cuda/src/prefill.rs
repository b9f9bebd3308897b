//! The prefill: a prompt in chunks of up to `chunk` tokens, each chunk through the 40 layers at once. Here the
//! whole pass over a chunk is shown in order; the matrix products (4-bit weights, bf16 activations, tensor cores)
//! are in [`crate::gemm`], the DeltaNet and attention mixers in [`crate::prefill_deltanet`] and [`crate::prefill_attention`],
//! the glue (embedding, norms, routing and sort, MoE combine) in kernels/prefill.cu.
//!
//! Activations: the residual stream stays f32; each product's input is rounded to bf16 once (after its RMSNorm
//! or gated norm). The KV pools, conv ring and recurrent state are the decode step's own buffers (a chunk belongs
//! to one sequence slot and uses its state and page-table row), so decode (or the next chunk) continues where a
//! chunk stops.

use half::bf16;
use lily_model::Config;

use crate::driver::{DevBuf, DevPtr, Gpu, Result};
use crate::gemm;
use crate::kernels::{prefill, Kernels, Q8x2};
use crate::launch::{Dims, Launcher};
use crate::model::{DeviceState, StateAt};
use crate::prefill_attention::AttentionScratch;
use crate::prefill_deltanet::{cuts_share_a_chunk, proj_dim, DeltaNetCut, DeltaNetScratch};
use crate::weights::{GpuGatedDeltaNet, GpuLayer, GpuMatrix, GpuMixer, GpuWeights};

/// Tokens a chunk takes at most (activation memory grows linearly with it: ~200 kB a token at the full shape).
pub const PREFILL_CHUNK: usize = 16384;

/// Rows of the prefill scratch for sequences of up to `max_context` tokens and `max_seqs` slots: a chunk (at most
/// [`PREFILL_CHUNK`], and no more than a sequence's context), but at least one row a slot, because a batched decode
/// step of every slot runs on the same scratch. More slots than [`PREFILL_CHUNK`] are refused where the model is
/// built.
pub fn scratch_rows(max_context: usize, max_seqs: usize) -> usize {
    PREFILL_CHUNK.min(max_context.max(max_seqs))
}

/// Sequences one pass takes at most (see [`ChunkPart`]).
pub const PREFILL_PARTS: usize = 64;

pub(crate) const ROW_THREADS: u32 = 256;

/// A chunk's activations, allocated once for `chunk` tokens.
pub struct PrefillScratch {
    pub chunk: usize,
    /// f32 `[chunk][hidden]`: the residual stream.
    pub(crate) hidden: DevBuf<f32>,
    /// bf16 `[chunk][hidden]`: the normed input of the mixer's or the MoE's products.
    pub(crate) normed: DevBuf<bf16>,
    /// bf16 `[chunk][hidden]`: what rounding the MoE's normed input to bf16 lost (the router takes both).
    pub(crate) normed_lo: DevBuf<bf16>,
    /// bf16 `[chunk][max(linear value dim, q dim)]`: the mixer's output, input of its output projection.
    pub(crate) mixed: DevBuf<bf16>,
    /// f32 `[chunk][mixer input projection rows]`.
    pub(crate) proj: DevBuf<f32>,
    /// f32 `[chunk][experts + 1]`: router logits, then the shared expert's gate logit.
    pub(crate) router_logits: DevBuf<f32>,
    /// `[chunk * slots]` by entry `token * slots + slot` (slots: [`gemm::moe_slots`], the routed experts, then the
    /// shared one as expert number `experts` with its sigmoid gate): expert ids (i32) and weights (f32).
    pub(crate) route_ids: DevBuf<i32>,
    pub(crate) route_w: DevBuf<f32>,
    /// i32 `[experts + 1]` and then `[1 + max_tiles]`, `[experts + 2]`, `[chunk * slots]`, `[max_tiles][2]`, `[1]`:
    /// the sort by expert. The first buffer also holds, after the counts, the small tiling's work counters and
    /// then each routed expert's tokens as bits (u32 `[experts][t.div_ceil(32)]` for `t` rows, from `route_rows`
    /// to `moe_sort`), so that one clearing zeroes all three.
    pub(crate) counts: DevBuf<i32>,
    pub(crate) offsets: DevBuf<i32>,
    pub(crate) entries: DevBuf<i32>,
    pub(crate) tiles: DevBuf<i32>,
    pub(crate) tile_count: DevBuf<i32>,
    pub(crate) max_tiles: usize,
    /// bf16 `[chunk * slots][moe inter]` by sorted entry (the large tiling's).
    pub(crate) act: DevBuf<bf16>,
    /// The small tiling's input and act as integer digits.
    pub(crate) codes: gemm::SmallCodes,
    /// bf16 `[chunk * slots][hidden]` by entry, weighted (each expert's rows rounded to bf16, as transformers keeps
    /// them; the sums over a token's slots are f32).
    pub(crate) expert_out: DevBuf<bf16>,
    pub(crate) deltanet: DeltaNetScratch,
    pub(crate) attn: AttentionScratch,
    /// f32 `[PREFILL_PARTS][hidden]`: each part's last hidden row, the head's input.
    pub(crate) last: DevBuf<f32>,
}

impl PrefillScratch {
    pub fn new(gpu: &Gpu, kernels: &Kernels, c: &Config, chunk: usize, max_context: usize) -> Result<PrefillScratch> {
        let (h, k) = (c.hidden_size, gemm::moe_slots(c));
        let proj_rows = (c.linear_conv_dim() + c.linear_value_dim() + 2 * c.linear_num_value_heads)
            .max(2 * c.q_dim() + 2 * c.kv_dim());
        let max_tiles = gemm::max_tiles_up_to(kernels, c, chunk);
        Ok(PrefillScratch {
            chunk,
            hidden: gpu.alloc(chunk * h)?,
            normed: gpu.alloc(chunk * h)?,
            normed_lo: gpu.alloc(chunk * h)?,
            mixed: gpu.alloc(chunk * c.linear_value_dim().max(c.q_dim()))?,
            proj: gpu.alloc(chunk * proj_rows)?,
            router_logits: gpu.alloc(chunk * (c.num_experts + 1))?,
            route_ids: gpu.alloc(chunk * k)?,
            route_w: gpu.alloc(chunk * k)?,
            counts: gpu.alloc(c.num_experts + 1 + 1 + max_tiles + c.num_experts * chunk.div_ceil(32))?,
            offsets: gpu.alloc(c.num_experts + 2)?,
            entries: gpu.alloc(chunk * k)?,
            tiles: gpu.alloc(max_tiles * 2)?,
            tile_count: gpu.alloc(1)?,
            max_tiles,
            act: gpu.alloc(chunk * k * c.moe_intermediate_size)?,
            codes: gemm::SmallCodes::new(gpu, kernels, c, chunk)?,
            expert_out: gpu.alloc(chunk * k * h)?,
            deltanet: DeltaNetScratch::new(gpu, c, chunk)?,
            attn: AttentionScratch::new(gpu, kernels, c, chunk, max_context)?,
            last: gpu.alloc(PREFILL_PARTS * h)?,
        })
    }

    /// How many of `counts`' words follow the counts before the masks: the small tiling's work counters.
    pub(crate) fn work_len(&self) -> usize {
        1 + self.max_tiles
    }

    /// Where the routed experts' token bits start in `counts` (see there).
    pub(crate) fn masks(&self, c: &Config) -> DevPtr<u32> {
        self.counts.at(c.num_experts + 1 + self.work_len()).cast()
    }

    /// The entries of `t` rows sorted by expert, as the grouped expert products take them (their grids cover the
    /// most tiles `t` rows can make, not the whole chunk's).
    fn sorted(&self, kernels: &Kernels, c: &Config, t: usize) -> gemm::Sorted {
        let tile_rows = gemm::moe_tile_rows(kernels, t);
        gemm::Sorted {
            entries: self.entries.ptr(),
            tiles: self.tiles.ptr(),
            tile_count: self.tile_count.ptr(),
            offsets: self.offsets.ptr(),
            work: self.counts.at(c.num_experts + 1),
            max_tiles: gemm::max_tiles(c, t, tile_rows).min(self.max_tiles),
            tile_rows,
            tokens: t,
            slots: gemm::moe_slots(c),
            rs: gemm::moe_takes_rs(kernels, t),
        }
    }
}

/// Where a chunk leaves a copy of the sequence's DeltaNet state as it stands after the chunk's first `tokens`
/// tokens (a snapshot taken inside the pass; the KV of those positions is in the pages already).
#[derive(Clone, Copy, Debug)]
pub struct Cut {
    pub tokens: usize,
    pub to: StateAt,
}

/// One sequence's rows in a prefill pass: its next `t` tokens, positions `start .. start + t` of the sequence in
/// slot `seq`. At `cuts` (ascending, inside the part) each DeltaNet mixer stops to copy the state out.
#[derive(Clone, Copy, Debug)]
pub struct ChunkPart<'a> {
    pub seq: usize,
    pub start: usize,
    pub t: usize,
    pub cuts: &'a [Cut],
}

/// Runs the token ids at `tokens` (device i32: the parts' tokens one after another, <= chunk in all) through every
/// layer, leaving each part's last hidden row at `last` (part i's at row i), ready for the head. The embedding,
/// norms, products and MoE take every part's rows at once, so one pass reads the weights once for all of them;
/// each mixer runs over one part's rows at a time, on that sequence's conv ring, recurrent state and KV pages.
/// `slot[l]` is layer l's index among the layers of its kind (its KV pools or DeltaNet state).
#[allow(clippy::too_many_arguments)]
pub fn enqueue_chunk(
    l: &mut Launcher,
    c: &Config,
    w: &GpuWeights,
    state: &DeviceState,
    slot: &[usize],
    s: &PrefillScratch,
    tokens: DevPtr<i32>,
    parts: &[ChunkPart<'_>],
    last: DevPtr<f32>,
) -> Result<()> {
    let t: usize = parts.iter().map(|p| p.t).sum();
    assert!(
        !parts.is_empty() && t <= s.chunk,
        "a chunk takes 1 ..= {} tokens in parts",
        s.chunk
    );
    for p in parts {
        assert!(
            p.t >= 1
                && p.cuts.iter().all(|cut| cut.tokens >= 1 && cut.tokens < p.t)
                && p.cuts.windows(2).all(|w| w[0].tokens < w[1].tokens),
            "a part of {} tokens with cuts inside it, ascending",
            p.t
        );
    }
    let rows = Dims::linear(t as u32, ROW_THREADS);
    prefill::embed_rows(l, rows, tokens, 0, w.embed_tokens.q4(), s.hidden.ptr())?;
    // The MoE rows of the layer before, which this layer's norm adds to the residual stream first.
    let mut experts = DevPtr::NULL;
    for (i, layer) in w.layers.iter().enumerate() {
        let (normed, codes) = (s.normed.ptr(), enqueue_input_norm(l, layer, s, t, experts)?);
        // The MoE's norm adds the output projection's parts of k, where the product leaves them.
        let out_parts = match &layer.mixer {
            GpuMixer::Linear(g) => {
                gemm::gemm_coded(l, normed, t, &g.in_proj, s.proj.ptr(), false, codes.is_some())?;
                // The mixer's norm also codes its rows for out_proj where that takes the integer small tiling.
                let out_codes = gemm::small_codes(l, t, &g.out_proj);
                let mut row = 0;
                for p in parts {
                    deltanet_mixer(l, c, state, slot[i], s, g, row, p, out_codes.unwrap_or(Q8x2::NONE))?;
                    row += p.t;
                }
                let coded = out_codes.is_some();
                gemm::gemm_coded_leaving_parts(l, s.mixed.ptr(), t, &g.out_proj, s.hidden.ptr(), coded)?
            }
            GpuMixer::Full(a) => {
                gemm::gemm_coded(l, normed, t, &a.qkv, s.proj.ptr(), false, codes.is_some())?;
                let (k_pool, v_pool) = (state.k_pool[slot[i]].ptr(), state.v_pool[slot[i]].ptr());
                let inv_freq = state.inv_freq.ptr();
                let mut row = 0;
                for p in parts {
                    let (proj, mixed) = (s.proj.at(row * a.qkv.rows), s.mixed.at(row * c.q_dim()));
                    let pages = state.page_row(p.seq);
                    s.attn
                        .run(l, c, p.t, p.start, proj, a, inv_freq, k_pool, v_pool, pages, mixed)?;
                    row += p.t;
                }
                gemm::gemm_coded_leaving_parts(l, s.mixed.ptr(), t, &a.o_proj, s.hidden.ptr(), false)?
            }
        };
        enqueue_moe(l, c, layer, s, t, out_parts)?;
        experts = s.expert_out.ptr();
    }
    prefill::moe_combine(l, rows, s.hidden.ptr(), experts)?;
    let h = c.hidden_size;
    let mut row = 0;
    for (i, p) in parts.iter().enumerate() {
        row += p.t;
        l.gpu.copy(last.offset(i * h), s.hidden.at((row - 1) * h), h)?;
    }
    Ok(())
}

/// The DeltaNet mixer of one layer over one part's projected rows (from row `row` of the pass), its output rows
/// also coded into `codes` (the pass's rows, [`Q8x2::NONE`] for none). A call takes up
/// to two cuts inside it in its pass (in different chunks of the call) and ends at the next cut, whose state it
/// leaves and which is copied: one call for up to three cuts in different chunks.
#[allow(clippy::too_many_arguments)]
fn deltanet_mixer(
    l: &mut Launcher,
    c: &Config,
    state: &DeviceState,
    layer: usize,
    s: &PrefillScratch,
    g: &GpuGatedDeltaNet,
    row: usize,
    part: &ChunkPart<'_>,
    codes: Q8x2,
) -> Result<()> {
    let (ring, recurrent) = (state.ring(layer, part.seq), state.recurrent_state(layer, part.seq));
    let mut done = 0;
    let mut cuts = part.cuts.iter().peekable();
    while done < part.t {
        let mut inside: Vec<DeltaNetCut> = Vec::with_capacity(2);
        while inside.len() < 2 {
            let Some(cut) = cuts.next_if(|cut| {
                inside
                    .last()
                    .is_none_or(|first| !cuts_share_a_chunk(first.tokens, cut.tokens - done))
            }) else {
                break;
            };
            let (ring, state) = state.deltanet_state(layer, cut.to);
            inside.push(DeltaNetCut {
                tokens: cut.tokens - done,
                ring,
                state,
            });
        }
        let at_end = cuts.next();
        let end = at_end.map_or(part.t, |cut| cut.tokens);
        let at = row + done;
        let (proj, mixed) = (s.proj.at(at * proj_dim(c)), s.mixed.at(at * c.linear_value_dim()));
        s.deltanet.run(
            l,
            c,
            end - done,
            part.start + done,
            proj,
            ring,
            recurrent,
            g,
            mixed,
            codes.from_row(at, c.linear_value_dim()),
            &inside,
        )?;
        if let Some(cut) = at_end {
            let (ring_to, recurrent_to) = state.deltanet_state(layer, cut.to);
            l.gpu.copy(ring_to, ring, state.ring_len(c))?;
            l.gpu.copy(recurrent_to, recurrent, state.recurrent_len(c))?;
        }
        done = end;
    }
    Ok(())
}

/// The input norm of layer `layer` over the `t` rows of `s.hidden` into `s.normed`, after adding `experts` (the
/// MoE rows of the layer before, null for none) to them. Where the mixer's input projection takes the integer small
/// tiling, the norm also codes its rows as that tiling's input: returns those codes, or `None`.
pub(crate) fn enqueue_input_norm(
    l: &mut Launcher,
    layer: &GpuLayer,
    s: &PrefillScratch,
    t: usize,
    experts: DevPtr<bf16>,
) -> Result<Option<Q8x2>> {
    let codes = gemm::small_codes(l, t, layer.mixer.input_projection());
    prefill::rmsnorm_rows(
        l,
        Dims::linear(t as u32, ROW_THREADS),
        s.hidden.ptr(),
        experts,
        DevPtr::NULL,
        0,
        layer.input_layernorm.ptr(),
        s.normed.ptr(),
        DevPtr::NULL,
        codes.unwrap_or(Q8x2::NONE),
    )?;
    Ok(codes)
}

/// The sparse MoE block of layer `layer` over the `t` rows of `s.hidden`: the post-attention norm, the router, the
/// sort of the (row, slot) entries by expert (the shared expert is each row's last slot) and the grouped expert
/// products, whose weighted rows it leaves in `s.expert_out` for the next norm (or `moe_combine`) to add to the
/// rows. A prefill chunk and a batched decode step both run it, one row a token. The norm first adds the `parts`
/// parts of k that the mixer's output projection left in the split slots (0: none; see
/// [`gemm::gemm_coded_leaving_parts`]).
pub(crate) fn enqueue_moe(
    l: &mut Launcher,
    c: &Config,
    layer: &GpuLayer,
    s: &PrefillScratch,
    t: usize,
    parts: usize,
) -> Result<()> {
    let rows = Dims::linear(t as u32, ROW_THREADS);
    let (normed, normed_lo) = (s.normed.ptr(), s.normed_lo.ptr());
    let norm = layer.post_attention_layernorm.ptr();
    // Where the experts take the small tiling, the norm also codes its rows (hi + lo) as the tiling's input.
    let sorted = s.sorted(l.kernels, c, t);
    let coded = sorted.small(l.kernels);
    assert!(
        !coded || t <= s.codes.tokens,
        "the small tiling's codes hold {} tokens, not {t}",
        s.codes.tokens
    );
    let norm_codes = if coded { s.codes.x() } else { Q8x2::NONE };
    prefill::rmsnorm_rows(
        l,
        rows,
        s.hidden.ptr(),
        DevPtr::NULL,
        l.kernels.buffer("gemm_partials"),
        parts as i32,
        norm,
        normed,
        normed_lo,
        norm_codes,
    )?;
    let kernel = router_kernel(l, t);
    router_logits(l, c, &layer.router, normed, normed_lo, t, s.router_logits.ptr(), kernel)?;
    route_and_sort(l, c, s, t)?;
    let (act, expert_out) = (s.act.ptr(), s.expert_out.ptr());
    let (route_w, codes) = (s.route_w.ptr(), &s.codes);
    gemm::moe_experts(
        l,
        normed,
        normed_lo,
        &sorted,
        route_w,
        &layer.experts(),
        act,
        codes,
        coded,
        expert_out,
    )
}

/// The kernels of the router's logits; all three give the same bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RouterKernel {
    /// `router_rows`: a strip of 16 router rows by 16 tokens a block (a batched step's rows, short prompts).
    Rows,
    /// `router_rows_tall`: several strips a block, each tile's inputs fetched once per group of strips.
    Tall,
    /// `router_rows_wide`: a block's inputs and codes staged in shared memory once for all its strips and tokens.
    Wide,
}

/// The router's kernel for `t` tokens: `router_rows_wide` from the kernels' `router_wide_min_tokens` tokens,
/// `router_rows_tall` from `router_tall_min_tokens`, else `router_rows` (a threshold of 0: never).
pub(crate) fn router_kernel(l: &Launcher, t: usize) -> RouterKernel {
    let from = |name| {
        let min = l.kernels.constant(name);
        min > 0 && t >= min
    };
    if from("router_wide_min_tokens") {
        RouterKernel::Wide
    } else if from("router_tall_min_tokens") {
        RouterKernel::Tall
    } else {
        RouterKernel::Rows
    }
}

/// `logits[r][e] = router[e] . (normed[r] + normed_lo[r])` for `t` rows (row stride experts + 1), one launch of
/// `kernel` at every count (a batched step's rows and a prompt's chunk alike). Routing follows small differences
/// between logits, so the router sees the normed input to about 16 bits (the bf16 part and what its rounding lost),
/// and a token's logits do not depend on the rows beside it.
#[allow(clippy::too_many_arguments)]
pub(crate) fn router_logits(
    l: &mut Launcher,
    c: &Config,
    router: &GpuMatrix,
    normed: DevPtr<bf16>,
    normed_lo: DevPtr<bf16>,
    t: usize,
    logits: DevPtr<f32>,
    kernel: RouterKernel,
) -> Result<()> {
    assert!(
        router.bits == 8 && router.rows == c.num_experts + 1 && router.cols == c.hidden_size,
        "router_rows takes the 8-bit [experts + 1][hidden] router"
    );
    let k = |name| l.kernels.constant(name);
    let strip = k("router_strip_rows");
    let strips = router.rows.div_ceil(strip);
    let (x, m, q) = (normed, t as i32, router.q4());
    match kernel {
        RouterKernel::Rows => {
            let dims = Dims::new(
                (strips as u32, t.div_ceil(k("router_tile_tokens")) as u32, 1),
                k("router_threads") as u32,
            );
            prefill::router_rows(l, dims, x, normed_lo, m, q, logits)
        }
        RouterKernel::Tall => {
            let blocks = (
                strips.div_ceil(k("router_tall_strips")) as u32,
                t.div_ceil(k("router_tile_tokens")) as u32,
                1,
            );
            let dims = Dims::new(blocks, k("router_threads") as u32);
            prefill::router_rows_tall(l, dims, x, normed_lo, m, q, logits)
        }
        RouterKernel::Wide => {
            let blocks = (
                strips.div_ceil(k("router_wide_strips")) as u32,
                t.div_ceil(k("router_wide_tokens")) as u32,
                1,
            );
            let dims = Dims::new(blocks, k("router_wide_threads") as u32).shared(k("router_wide_smem") as u32);
            prefill::router_rows_wide(l, dims, x, normed_lo, m, q, logits)
        }
    }
}

/// The routing of `t` tokens from `s.router_logits` (ids, weights, the shared expert's gate) and the stable sort of
/// their (token, slot) entries by expert, with the tiles of the grouped products: one block of `moe_route_sort`
/// up to `route_sort_max_tokens` tokens, else the counts cleared, `route_rows` and `moe_sort`.
pub(crate) fn route_and_sort(l: &mut Launcher, c: &Config, s: &PrefillScratch, t: usize) -> Result<()> {
    let masks = t >= l.kernels.constant("sort_masks_min_tokens");
    route_and_sort_by(l, c, s, t, masks)
}

/// [`route_and_sort`], with `moe_sort` reading each expert's tokens from bits that `route_rows` sets (`masks`)
/// or passing over every entry: the two give the same order, and the selftest checks both at every count.
pub(crate) fn route_and_sort_by(l: &mut Launcher, c: &Config, s: &PrefillScratch, t: usize, masks: bool) -> Result<()> {
    let tile_rows = gemm::moe_tile_rows(l.kernels, t) as i32;
    let groups = c.num_experts + 1;
    if t <= l.kernels.constant("route_sort_max_tokens") {
        return prefill::moe_route_sort(
            l,
            Dims::linear(1, l.kernels.constant("route_sort_threads") as u32),
            s.router_logits.ptr(),
            t as i32,
            tile_rows,
            s.route_ids.ptr(),
            s.route_w.ptr(),
            s.counts.ptr(),
            s.work_len() as i32,
            s.offsets.ptr(),
            s.entries.ptr(),
            s.tiles.ptr(),
            s.tile_count.ptr(),
        );
    }
    let mask_words = if masks { t.div_ceil(32) } else { 0 };
    let mask_ptr = if masks { s.masks(c) } else { DevPtr::NULL };
    // The counts, the work counters and the masks of t rows, in one clearing.
    l.gpu
        .memset_u32(s.counts.ptr(), 0, groups + s.work_len() + c.num_experts * mask_words)?;
    let warps_per_block = ROW_THREADS as usize / 32;
    prefill::route_rows(
        l,
        Dims::linear(t.div_ceil(warps_per_block) as u32, ROW_THREADS),
        s.router_logits.ptr(),
        t as i32,
        s.route_ids.ptr(),
        s.route_w.ptr(),
        s.counts.ptr(),
        mask_ptr,
        mask_words as i32,
    )?;
    prefill::moe_sort(
        l,
        Dims::linear(groups as u32, 256),
        s.route_ids.ptr(),
        t as i32,
        s.counts.ptr(),
        mask_ptr,
        mask_words as i32,
        tile_rows,
        s.offsets.ptr(),
        s.entries.ptr(),
        s.tiles.ptr(),
        s.tile_count.ptr(),
    )
}

#[cfg(test)]
mod tests {
    use super::{scratch_rows, PREFILL_CHUNK};

    #[test]
    fn the_scratch_holds_a_step_of_every_slot_and_a_chunk_of_a_context() {
        // More slots than a sequence's context: a batched step of every slot still fits.
        assert_eq!(scratch_rows(64, 256), 256);
        // A long context: one chunk, whatever the slots.
        assert_eq!(scratch_rows(262_144, 256), PREFILL_CHUNK);
        // A short context and one slot: no more rows than the context.
        assert_eq!(scratch_rows(100, 1), 100);
    }
}
