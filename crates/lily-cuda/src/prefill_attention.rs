//! The gated full-attention mixer of the prefill, between the q/k/v input projection and o_proj (kernels in
//! kernels/attention_prefill.cu): q/k norms, partial RoPE and the KV cache write (`attn_prefill_prep`), causal flash
//! attention on tensor cores for 16 query tokens x the 8 query heads of a KV head per block (`attn_prefill`), and,
//! when those blocks alone would leave SMs idle, the key range split into chunks whose parts `attn_prefill_merge`
//! combines with the output gate.

use half::bf16;
use lily_model::Config;

use crate::driver::{DevBuf, DevPtr, Gpu, GpuError, Result};
use crate::kernels::attention_prefill;
use crate::launch::{Dims, Launcher};
use crate::weights::GpuAttention;

/// Query tokens per block of `attn_prefill` (QUERY_TILE in the kernel file).
const QUERY_TILE: usize = 16;
/// Keys per pipelined K/V tile (KEY_TILE in the kernel file); key chunks are whole tiles, and a tile is one page.
const KEY_TILE: usize = crate::pages::KV_PAGE;
/// Fewest key tiles a chunk takes when the keys are split: each part costs a Q tile load and a 128-row f32 write.
const MIN_CHUNK_TILES: usize = 8;
/// Threads of the row kernels (prep, merge): one warp per (token, head).
const ROW_THREADS: u32 = 256;

/// How `attn_prefill` covers the keys: chunks of `chunk` keys, at most `splits` of them for a query tile.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct KeySplit {
    pub(crate) chunk: usize,
    pub(crate) splits: usize,
}

/// Chunks wanted for `t` tokens: one (the whole causal range of each query tile) while query tiles x KV heads
/// fill the SMs; otherwise enough for about two blocks per SM.
fn wanted_splits(t: usize, kv_heads: usize, sm_count: usize) -> usize {
    let blocks = t.div_ceil(QUERY_TILE) * kv_heads;
    if blocks >= sm_count {
        1
    } else {
        (2 * sm_count).div_ceil(blocks)
    }
}

/// The wanted chunks, none shorter than MIN_CHUNK_TILES tiles (so never more than wanted).
pub(crate) fn key_split(t: usize, start: usize, kv_heads: usize, sm_count: usize) -> KeySplit {
    let key_tiles = (start + t).div_ceil(KEY_TILE);
    let splits = wanted_splits(t, kv_heads, sm_count)
        .min(key_tiles / MIN_CHUNK_TILES)
        .max(1);
    let chunk_tiles = key_tiles.div_ceil(splits);
    KeySplit {
        chunk: chunk_tiles * KEY_TILE,
        splits: key_tiles.div_ceil(chunk_tiles),
    }
}

/// The attention's buffers for up to `max_tokens` tokens a call.
pub struct AttentionScratch {
    pub(crate) max_tokens: usize,
    pub(crate) sm_count: usize,
    /// bf16 `[token][heads][head_dim]`: normed, rotated queries times 1/sqrt(head_dim).
    pub(crate) q: DevBuf<bf16>,
    /// f32 `[split][token][heads][head_dim]`: a key chunk's unnormalised output.
    pub(crate) part_o: DevBuf<f32>,
    /// f32 `[split][token][heads][2]`: a key chunk's row max (log2 units) and sum of exponentials.
    pub(crate) part_ml: DevBuf<f32>,
}

impl AttentionScratch {
    pub fn new(gpu: &Gpu, config: &Config, max_tokens: usize) -> Result<AttentionScratch> {
        let c = config;
        // The most part rows any call may need (a call with one chunk writes none).
        let part_rows = (1..=max_tokens)
            .map(|t| match wanted_splits(t, c.num_key_value_heads, gpu.sm_count) {
                1 => 0,
                splits => splits * t,
            })
            .max()
            .unwrap_or(0);
        Ok(AttentionScratch {
            max_tokens,
            sm_count: gpu.sm_count,
            q: gpu.alloc(max_tokens * c.q_dim())?,
            part_o: gpu.alloc(part_rows * c.q_dim())?,
            part_ml: gpu.alloc(part_rows * c.num_attention_heads * 2)?,
        })
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
        let split = key_split(t, start, kv_heads, self.sm_count);
        let group = heads / kv_heads;
        let shared = (group * QUERY_TILE + 4 * KEY_TILE) * head_dim * 2;
        let grid = ((t.div_ceil(QUERY_TILE) * kv_heads) as u32, split.splits as u32, 1);
        attention_prefill::attn_prefill(
            l,
            Dims::new(grid, (group * 32) as u32).shared(shared as u32),
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
            assert!(s.splits <= wanted_splits(t, kv_heads, sms));
        }
        assert_eq!(key_split(4096, 32_768, 2, 132).splits, 1);
        assert!(key_split(130, 1001, 2, 132).splits > 1);
    }
}
