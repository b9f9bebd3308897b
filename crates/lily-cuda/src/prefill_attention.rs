//! The gated full-attention mixer of the prefill, between the q/k/v input projection and o_proj (kernels in
//! kernels/attention_prefill.cu): q/k norms, partial RoPE and the KV cache write (`attn_prefill_prep`), causal flash
//! attention on tensor cores for 16 query tokens x the 8 query heads of a KV head per block (`attn_prefill_wgmma`
//! on warpgroup MMAs where the build is sm_90a, `attn_prefill` on mma.sync elsewhere), and,
//! when those blocks alone would leave SMs idle, the key range split into chunks whose parts `attn_prefill_merge`
//! combines with the output gate. Where the build has it (sm_90a) and the switch is on, `attn_prefill_i8` takes the
//! scores from 8-bit codes of q and the (mean-smoothed) keys instead, which `attn_prefill_key_mean` and
//! `attn_prefill_codes` write first.

use half::bf16;
use lily_model::Config;

use crate::driver::{DevBuf, DevPtr, Gpu, GpuError, Result};
use crate::kernels::{attention_prefill, Kernels};
use crate::launch::{Dims, Launcher};
use crate::weights::GpuAttention;

/// Query tokens per block of `attn_prefill` (QUERY_TILE in the kernel file).
const QUERY_TILE: usize = 16;
/// Keys per pipelined K/V tile (KEY_TILE in the kernel file); key chunks are whole tiles, and a tile is one page.
const KEY_TILE: usize = crate::pages::KV_PAGE;
/// Fewest key tiles a chunk takes when the keys are split: each part costs a Q tile load and a 128-row f32 write.
const MIN_CHUNK_TILES: usize = 8;
/// What a key chunk's part costs beside its tiles, in key tiles of one block: its 128 rows of f32 output written
/// and read back by the merge (256 KiB through memory, ~85 ns of the whole GPU's bandwidth) against a key tile's
/// ~3.5 us on one SM of 132.
const PART_COST_TILES: f64 = 1.0 / 40.0;
/// Threads of the row kernels (prep, merge): one warp per (token, head).
const ROW_THREADS: u32 = 256;

/// How `attn_prefill` covers the keys: chunks of `chunk` keys, at most `splits` of them for a query tile.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct KeySplit {
    pub(crate) chunk: usize,
    pub(crate) splits: usize,
}

/// The most chunks considered for `t` tokens: one (the whole causal range of each query tile) while query tiles x
/// KV heads fill the SMs; otherwise up to four blocks per SM.
fn max_splits(t: usize, kv_heads: usize, sm_count: usize) -> usize {
    let blocks = t.div_ceil(QUERY_TILE) * kv_heads;
    if blocks >= sm_count {
        1
    } else {
        (4 * sm_count).div_ceil(blocks)
    }
}

/// The split of the keys for `t` tokens at positions `start ..` whose estimated time is least. A block (one SM)
/// works through its chunk's tiles in turn and the blocks start longest first, so the estimate places the blocks'
/// tile counts longest first, each on the SM that frees first, and adds PART_COST_TILES for each part written. Too
/// few chunks leave SMs idle at the end (420 tokens after 16K keys are 54 blocks of ~260 tiles; in 5 chunks they
/// are 270 blocks, two rounds of 132 SMs and a third for 6), too many cost their parts' traffic. Chunks are at
/// least MIN_CHUNK_TILES tiles.
pub(crate) fn key_split(t: usize, start: usize, kv_heads: usize, sm_count: usize) -> KeySplit {
    let key_tiles = (start + t).div_ceil(KEY_TILE);
    let query_tiles = t.div_ceil(QUERY_TILE);
    // Key tiles query tile i reaches (its last token's position and all before it).
    let reach: Vec<usize> = (0..query_tiles)
        .map(|i| (start + (QUERY_TILE * (i + 1)).min(t)).div_ceil(KEY_TILE))
        .collect();
    let mut best = (
        f64::INFINITY,
        KeySplit {
            chunk: key_tiles * KEY_TILE,
            splits: 1,
        },
    );
    let most = max_splits(t, kv_heads, sm_count).min((key_tiles / MIN_CHUNK_TILES).max(1));
    let mut last_chunk = 0;
    let mut blocks = Vec::new();
    for wanted in 1..=most {
        let chunk_tiles = key_tiles.div_ceil(wanted);
        if chunk_tiles == last_chunk {
            continue;
        }
        last_chunk = chunk_tiles;
        let splits = key_tiles.div_ceil(chunk_tiles);
        blocks.clear();
        for &r in &reach {
            for _ in 0..kv_heads {
                blocks.extend(std::iter::repeat_n(chunk_tiles, r / chunk_tiles));
                if r % chunk_tiles > 0 {
                    blocks.push(r % chunk_tiles);
                }
            }
        }
        let parts = if splits > 1 { blocks.len() } else { 0 };
        let cost = longest_first_makespan(&mut blocks, sm_count) as f64 + parts as f64 * PART_COST_TILES;
        if cost < best.0 {
            best = (
                cost,
                KeySplit {
                    chunk: chunk_tiles * KEY_TILE,
                    splits,
                },
            );
        }
    }
    best.1
}

/// The time `lengths` take on `workers` when each, longest first, goes to the worker that frees first.
fn longest_first_makespan(lengths: &mut [usize], workers: usize) -> usize {
    use std::cmp::Reverse;
    if lengths.len() <= workers {
        return lengths.iter().copied().max().unwrap_or(0);
    }
    lengths.sort_unstable_by(|a, b| b.cmp(a));
    let mut free_at: std::collections::BinaryHeap<Reverse<usize>> = (0..workers).map(|_| Reverse(0)).collect();
    let mut end = 0;
    for &len in lengths.iter() {
        let Reverse(at) = free_at.pop().expect("workers > 0");
        end = end.max(at + len);
        free_at.push(Reverse(at + len));
    }
    end
}

/// `attn_prefill`'s launcher type, which `attn_prefill_wgmma`'s shares.
type AttnKernel = fn(
    &mut Launcher,
    Dims,
    DevPtr<bf16>,
    DevPtr<bf16>,
    DevPtr<bf16>,
    DevPtr<i32>,
    DevPtr<f32>,
    i32,
    i32,
    i32,
    DevPtr<bf16>,
    DevPtr<f32>,
    DevPtr<f32>,
) -> Result<()>;

/// The 8-bit codes `attn_prefill_i8` reads (see kernels/attention_prefill.cu), for up to `max_tokens` tokens a call
/// and every position of the context.
pub(crate) struct ScoreCodes {
    /// f32 `[kv heads][head_dim]`: the mean key subtracted before coding.
    mean: DevBuf<f32>,
    /// i8 `[token][heads][head_dim]` and f32 `[token][heads]`: the call's queries.
    q8: DevBuf<i8>,
    q_scale: DevBuf<f32>,
    /// i8 `[position][kv heads][head_dim]` and f32 `[kv heads][scale_stride]`: every key up to the call's last.
    k8: DevBuf<i8>,
    k_scale: DevBuf<f32>,
    scale_stride: usize,
    /// Where the build has ATTN_I8_V8: u8 `[kv heads][scale_stride / 64][16 KiB]` and f32 `[kv heads][scale_stride
    /// / 64]`, the values as e4m3 codes and their scales (see attn_prefill_v_codes), and f32 `[kv heads]`, each
    /// head's largest value magnitude where the scales are per head (ATTN_I8_V8_ROW).
    v8: Option<(DevBuf<u8>, DevBuf<f32>, DevBuf<f32>)>,
}

impl ScoreCodes {
    /// Codes for calls of up to `max_tokens` tokens in contexts of up to `positions` positions.
    fn new(gpu: &Gpu, config: &Config, max_tokens: usize, positions: usize, values: bool) -> Result<ScoreCodes> {
        let c = config;
        // A key tile reads 64 scales from its first key on: whole tiles past the last position stay in the row.
        let scale_stride = positions.next_multiple_of(KEY_TILE);
        Ok(ScoreCodes {
            mean: gpu.alloc(c.kv_dim())?,
            q8: gpu.alloc(max_tokens * c.q_dim())?,
            q_scale: gpu.alloc(max_tokens * c.num_attention_heads)?,
            k8: gpu.alloc(positions * c.kv_dim())?,
            k_scale: gpu.alloc_zeroed(c.num_key_value_heads * scale_stride)?,
            scale_stride,
            v8: match values {
                true => Some((
                    gpu.alloc(scale_stride * c.kv_dim())?,
                    gpu.alloc_zeroed(c.num_key_value_heads * scale_stride / KEY_TILE)?,
                    gpu.alloc_zeroed(c.num_key_value_heads)?,
                )),
                false => None,
            },
        })
    }
}

/// Whether the kernel file was built with the values in e4m3 (ATTN_I8_V8), which `attn_prefill_i8` then reads
/// from codes of their own.
pub(crate) fn values8(kernels: &Kernels) -> bool {
    kernels.constant("attn_prefill_i8_v8") == 1
}

/// Whether the e4m3 values have one scale per KV head (ATTN_I8_V8_ROW) rather than per block of positions.
pub(crate) fn values8_per_head(kernels: &Kernels) -> bool {
    kernels.constant("attn_prefill_i8_v8_row") == 1
}

/// When `attn_prefill_i8` takes the scores from 8-bit codes instead of `attn_prefill_wgmma` from bf16.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Int8Scores {
    Never,
    Always,
    /// For calls of at least LONG_MIN_TOKENS tokens that reach LONG_MIN_KEYS keys: there the attention's products
    /// are a large share of the call and the codes pay for their own pass (measured faster for 4,096-token calls
    /// after 4,096 keys and more; see bench/RESULTS.md; shorter calls were not measured). Other calls, a chat turn
    /// after a long history included, keep the bf16 kernel, whose time the codes' pass over every key would not
    /// repay.
    Long,
}

/// Int8Scores::Long's thresholds.
const LONG_MIN_TOKENS: usize = 4096;
const LONG_MIN_KEYS: usize = 8192;

impl Int8Scores {
    fn from_constant(value: usize) -> Int8Scores {
        match value {
            0 => Int8Scores::Never,
            1 => Int8Scores::Always,
            _ => Int8Scores::Long,
        }
    }

    /// Whether some call of up to `max_tokens` tokens in a context of `max_context` positions would take them.
    fn ever(self, max_tokens: usize, max_context: usize) -> bool {
        max_tokens <= max_context && self.applies(max_tokens, max_context - max_tokens)
    }

    /// Whether a call of `t` tokens at positions `start ..` takes the codes.
    fn applies(self, t: usize, start: usize) -> bool {
        match self {
            Int8Scores::Never => false,
            Int8Scores::Always => true,
            Int8Scores::Long => t >= LONG_MIN_TOKENS && start + t >= LONG_MIN_KEYS,
        }
    }
}

/// Whether `LILY_KERNEL_DEFINES` switches ATTN_I8_V8 on (any integer but 0, as the kernels read it: their constant
/// `attn_prefill_i8_v8`), for the memory plan made before they are compiled.
pub(crate) fn values8_requested() -> bool {
    crate::kernels::tuning_define("ATTN_I8_V8").is_some_and(|v| v.trim().parse::<i64>().is_ok_and(|n| n != 0))
}

/// Device bytes of `ScoreCodes` beside the per-token ones (a key row and a scale for each of `max_context`
/// positions, and with `values8` a value row and a scale per KEY_TILE positions) that an engine with calls of up to
/// `max_tokens` tokens holds on a GPU of compute capability `cc` under the kernel file's default gate: none where
/// the kernel is not built (other GPUs than sm_90a) or no call could pass the gate.
pub(crate) fn score_codes_context_bytes(
    config: &Config,
    cc: (i32, i32),
    max_tokens: usize,
    max_context: usize,
    values8: bool,
) -> usize {
    let c = config;
    let max_context = max_context.min(c.max_position_embeddings);
    let built = crate::kernels::Target::for_device(cc).has_sm90a_features();
    let positions = max_context.next_multiple_of(KEY_TILE);
    let value_bytes = match values8 {
        true => positions * c.kv_dim() + (positions / KEY_TILE + 1) * 4 * c.num_key_value_heads,
        false => 0,
    };
    match built && Int8Scores::Long.ever(max_tokens, max_context) {
        true => positions * (c.kv_dim() + 4 * c.num_key_value_heads) + value_bytes,
        false => 0,
    }
}

/// The attention's buffers for up to `max_tokens` tokens a call.
pub struct AttentionScratch {
    pub(crate) max_tokens: usize,
    /// The most positions a sequence reaches (the codes' key rows).
    max_context: usize,
    pub(crate) sm_count: usize,
    /// bf16 `[token][heads][head_dim]`: normed, rotated queries times 1/sqrt(head_dim).
    pub(crate) q: DevBuf<bf16>,
    /// f32 `[split][token][heads][head_dim]`: a key chunk's unnormalised output.
    pub(crate) part_o: DevBuf<f32>,
    /// f32 `[split][token][heads][2]`: a key chunk's row max (log2 units) and sum of exponentials.
    pub(crate) part_ml: DevBuf<f32>,
    /// The last call's (tokens, start) and key split: every attention layer of a prefill chunk asks for the same.
    last_split: std::cell::Cell<Option<(usize, usize, KeySplit)>>,
    /// Run `attn_prefill` even where this build has `attn_prefill_wgmma`, so that the selftest checks the kernel
    /// other GPUs run as well.
    pub(crate) portable: std::cell::Cell<bool>,
    /// The codes of `attn_prefill_i8`, where this build has it and runs it.
    codes: Option<ScoreCodes>,
    /// When the scores come from 8-bit codes (`attn_prefill_i8`), where the codes exist: the kernel file's
    /// ATTN_PREFILL_I8 sets it; the selftest adds the codes and runs both ways.
    pub(crate) int8_scores: std::cell::Cell<Int8Scores>,
    /// Calls queued on `attn_prefill_i8` so far, for the selftest to see that a prompt reached it.
    pub(crate) int8_calls: std::cell::Cell<usize>,
}

impl AttentionScratch {
    /// Buffers for calls of up to `max_tokens` tokens in sequences of up to `max_context` positions (at most the
    /// config's max_position_embeddings).
    pub fn new(
        gpu: &Gpu,
        kernels: &Kernels,
        config: &Config,
        max_tokens: usize,
        max_context: usize,
    ) -> Result<AttentionScratch> {
        let c = config;
        // The most part rows any call may need (a call with one chunk writes none).
        let part_rows = (1..=max_tokens)
            .map(|t| match max_splits(t, c.num_key_value_heads, gpu.sm_count) {
                1 => 0,
                splits => splits * t,
            })
            .max()
            .unwrap_or(0);
        let max_context = max_context.min(c.max_position_embeddings);
        let int8_scores = Int8Scores::from_constant(kernels.constant("attn_prefill_i8_default"));
        Ok(AttentionScratch {
            max_tokens,
            max_context,
            sm_count: gpu.sm_count,
            q: gpu.alloc(max_tokens * c.q_dim())?,
            part_o: gpu.alloc(part_rows * c.q_dim())?,
            part_ml: gpu.alloc(part_rows * c.num_attention_heads * 2)?,
            last_split: std::cell::Cell::new(None),
            portable: std::cell::Cell::new(false),
            // The codes only where the kernel can run by default (they hold a key row for every position):
            // `with_score_codes` adds them for the selftest.
            codes: match kernels.constant("attn_prefill_i8_built") == 1 && int8_scores.ever(max_tokens, max_context) {
                true => Some(ScoreCodes::new(gpu, c, max_tokens, max_context, values8(kernels))?),
                false => None,
            },
            int8_scores: std::cell::Cell::new(int8_scores),
            int8_calls: std::cell::Cell::new(0),
        })
    }

    /// Whether the codes of `attn_prefill_i8` exist, so that `int8_scores` can take effect.
    pub(crate) fn has_score_codes(&self) -> bool {
        self.codes.is_some()
    }

    /// The same scratch with the codes of `attn_prefill_i8` where the build has it, whatever its default.
    pub(crate) fn with_score_codes(mut self, gpu: &Gpu, kernels: &Kernels, config: &Config) -> Result<Self> {
        if self.codes.is_none() && kernels.constant("attn_prefill_i8_built") == 1 {
            self.codes = Some(ScoreCodes::new(
                gpu,
                config,
                self.max_tokens,
                self.max_context,
                values8(kernels),
            )?);
        }
        Ok(self)
    }

    /// Queues the attention of `t` tokens at positions `start ..` of one sequence over the paged KV pools (bf16
    /// `[page][KV_PAGE][kv heads][head_dim]`; `pages` is the sequence's page-table row, i32, whose pages hold at
    /// least `start + t` positions; positions below `start` already filled): `proj` is f32
    /// `[t][2 q_dim + 2 kv_dim]` (per head [query | gate], then k, then v), `inv_freq` f32 `[rotary_dim / 2]`, `out`
    /// bf16 `[t][q_dim]` (attention times sigmoid(gate)). Writes the new keys and values into the pools.
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &self,
        l: &mut Launcher,
        config: &Config,
        t: usize,
        start: usize,
        proj: DevPtr<f32>,
        weights: &GpuAttention,
        inv_freq: DevPtr<f32>,
        k_pool: DevPtr<bf16>,
        v_pool: DevPtr<bf16>,
        pages: DevPtr<i32>,
        out: DevPtr<bf16>,
    ) -> Result<()> {
        let c = config;
        if t == 0 || t > self.max_tokens || start + t > c.max_position_embeddings {
            return Err(GpuError::Other(format!(
                "attention prefill of {t} tokens at {start}: 1 ..= {} tokens, up to position {}",
                self.max_tokens, c.max_position_embeddings
            )));
        }
        let (heads, kv_heads, head_dim) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let warps_per_block = ROW_THREADS as usize / 32;
        let (t32, start32) = (t as i32, start as i32);
        attention_prefill::attn_prefill_prep(
            l,
            Dims::linear((t * (heads + kv_heads)).div_ceil(warps_per_block) as u32, ROW_THREADS),
            proj,
            weights.q_norm.ptr(),
            weights.k_norm.ptr(),
            inv_freq,
            t32,
            start32,
            self.q.ptr(),
            k_pool,
            v_pool,
            pages,
        )?;
        let split = match self.last_split.get() {
            Some((t0, start0, split)) if (t0, start0) == (t, start) => split,
            _ => {
                let split = key_split(t, start, kv_heads, self.sm_count);
                self.last_split.set(Some((t, start, split)));
                split
            }
        };
        let group = heads / kv_heads;
        let grid = ((t.div_ceil(QUERY_TILE) * kv_heads) as u32, split.splits as u32, 1);
        let block = (group * 32) as u32;
        match self
            .codes
            .as_ref()
            .filter(|_| self.int8_scores.get().applies(t, start) && start + t <= self.max_context)
            .filter(|_| !self.portable.get())
        {
            Some(codes) => {
                self.int8_calls.set(self.int8_calls.get() + 1);
                let v_max = match &codes.v8 {
                    Some((_, _, v_max)) if values8_per_head(l.kernels) => v_max.ptr(),
                    _ => DevPtr::NULL,
                };
                attention_prefill::attn_prefill_key_mean(
                    l,
                    Dims::linear(kv_heads as u32, ROW_THREADS),
                    k_pool,
                    pages,
                    t32,
                    start32,
                    codes.mean.ptr(),
                    v_max,
                )?;
                let rows = t * heads + (start + t) * kv_heads;
                attention_prefill::attn_prefill_codes(
                    l,
                    Dims::linear(rows.div_ceil(warps_per_block) as u32, ROW_THREADS),
                    self.q.ptr(),
                    k_pool,
                    pages,
                    codes.mean.ptr(),
                    t32,
                    start32,
                    codes.scale_stride as i32,
                    codes.q8.ptr(),
                    codes.q_scale.ptr(),
                    codes.k8.ptr(),
                    codes.k_scale.ptr(),
                )?;
                let (v8, v_scale) = match &codes.v8 {
                    Some((v8, v_scale, _)) => {
                        let positions = start + t;
                        let dims = Dims::new((positions.div_ceil(KEY_TILE) as u32, kv_heads as u32, 1), 256);
                        if v_max.raw() != 0 {
                            attention_prefill::attn_prefill_v_max(l, dims, v_pool, pages, positions as i32, v_max)?;
                        }
                        attention_prefill::attn_prefill_v_codes(
                            l,
                            dims,
                            v_pool,
                            pages,
                            positions as i32,
                            codes.scale_stride as i32,
                            v_max,
                            v8.ptr(),
                            v_scale.ptr(),
                        )?;
                        (v8.ptr(), v_scale.ptr())
                    }
                    None => (DevPtr::NULL, DevPtr::NULL),
                };
                attention_prefill::attn_prefill_i8(
                    l,
                    Dims::new(grid, block).shared(l.kernels.constant("attn_prefill_i8_smem") as u32),
                    codes.q8.ptr(),
                    codes.q_scale.ptr(),
                    codes.k8.ptr(),
                    codes.k_scale.ptr(),
                    codes.scale_stride as i32,
                    v8,
                    v_scale,
                    v_pool,
                    pages,
                    proj,
                    t32,
                    start32,
                    split.chunk as i32,
                    out,
                    self.part_o.ptr(),
                    self.part_ml.ptr(),
                )?;
            }
            None => {
                // The warpgroup kernel where this build has it (sm_90a): the same grid and outputs.
                let wgmma = l.kernels.constant("attn_prefill_wgmma_built") == 1 && !self.portable.get();
                let (kernel, shared): (AttnKernel, usize) = match wgmma {
                    true => (
                        attention_prefill::attn_prefill_wgmma,
                        l.kernels.constant("attn_prefill_wgmma_smem"),
                    ),
                    false => (
                        attention_prefill::attn_prefill,
                        (group * QUERY_TILE + 4 * KEY_TILE) * head_dim * 2,
                    ),
                };
                kernel(
                    l,
                    Dims::new(grid, block).shared(shared as u32),
                    self.q.ptr(),
                    k_pool,
                    v_pool,
                    pages,
                    proj,
                    t32,
                    start32,
                    split.chunk as i32,
                    out,
                    self.part_o.ptr(),
                    self.part_ml.ptr(),
                )?;
            }
        }
        if split.splits > 1 {
            attention_prefill::attn_prefill_merge(
                l,
                Dims::linear((t * heads).div_ceil(warps_per_block) as u32, ROW_THREADS),
                self.part_o.ptr(),
                self.part_ml.ptr(),
                proj,
                t32,
                start32,
                split.chunk as i32,
                out,
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn int8_scores_for_long_calls_only() {
        let long = Int8Scores::Long;
        assert!(long.applies(4096, 4096) && long.applies(16_384, 0) && long.applies(4096, 131_072));
        // A chat turn after a long history, a short prompt, a long prompt's first chunk below the keys.
        assert!(!long.applies(16, 32_768) && !long.applies(4095, 100_000) && !long.applies(4096, 0));
        assert!(Int8Scores::Always.applies(1, 0) && !Int8Scores::Never.applies(131_072, 131_072));
        assert_eq!(Int8Scores::from_constant(2), long);
        // Whether the codes are worth allocating: a chunk too short or a context too small never takes them.
        assert!(long.ever(4096, 8192) && !long.ever(2048, 262_144) && !long.ever(16_384, 4096));
        assert!(Int8Scores::Always.ever(1, 1) && !Int8Scores::Never.ever(16_384, 262_144));
    }

    #[test]
    fn the_memory_plan_counts_the_codes_where_they_are_allocated() {
        let c = Config::full_shape();
        // 32,768 positions a key row of 512 bytes and two 4-byte scales.
        assert_eq!(
            score_codes_context_bytes(&c, (9, 0), 16_384, 32_768, false),
            32_768 * 520
        );
        // With the values in e4m3, also a value row of 512 bytes a position, two scales a block of 64, and each
        // head's largest value.
        let values8 = 32_768 * 1032 + 512 * 8 + 8;
        assert_eq!(score_codes_context_bytes(&c, (9, 0), 16_384, 32_768, true), values8);
        // Another GPU has no int8 kernel; a context or a chunk too small never passes the gate.
        for values8 in [false, true] {
            assert_eq!(score_codes_context_bytes(&c, (8, 9), 16_384, 32_768, values8), 0);
            assert_eq!(score_codes_context_bytes(&c, (9, 0), 4096, 4096, values8), 0);
            assert_eq!(score_codes_context_bytes(&c, (9, 0), 2048, 262_144, values8), 0);
        }
    }

    #[test]
    fn key_chunks_cover_every_query_tile() {
        for (t, start, kv_heads, sms) in [
            (1, 0, 2, 132),
            (4096, 0, 2, 132),
            (130, 1001, 2, 132),
            (1, 262_143, 1, 132),
            (512, 0, 2, 132),
            (300, 0, 1, 132),
        ] {
            let s = key_split(t, start, kv_heads, sms);
            assert_eq!(s.chunk % KEY_TILE, 0);
            assert!(
                s.splits * s.chunk >= start + t && (s.splits - 1) * s.chunk < start + t,
                "{t} {start}: {s:?}"
            );
            assert!(s.splits <= max_splits(t, kv_heads, sms));
        }
        assert_eq!(key_split(4096, 32_768, 2, 132).splits, 1);
        assert!(key_split(130, 1001, 2, 132).splits > 1);
        // 420 tokens after 16K: 54 blocks without a split, each of ~260 key tiles. Five chunks would make 270
        // blocks, two rounds of 132 SMs and a third for 6; the split chosen must keep its last round three
        // quarters full.
        let s = key_split(420, 16_384, 2, 132);
        let blocks = 54 * s.splits;
        assert!(blocks * 4 >= blocks.div_ceil(132) * 132 * 3, "{s:?}: {blocks} blocks");
    }
}
