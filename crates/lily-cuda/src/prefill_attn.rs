//! The gated full-attention mixer of the prefill, between the q/k/v input projection and o_proj (kernels in
//! kernels/attention_prefill.cu): q/k norms, partial RoPE and the KV cache write (`attn_prefill_prep`), causal flash
//! attention on tensor cores for 16 query tokens x the 8 query heads of a KV head per block (`attn_prefill`), and,
//! when those blocks alone would leave SMs idle, the key range split into chunks whose parts `attn_prefill_merge`
//! combines with the output gate.

use half::bf16;
use lily_model::cpu::attention::{attend, rope, rope_inv_freq};
use lily_model::cpu::linalg::{rmsnorm, sigmoid};
use lily_model::rng::Rng;
use lily_model::Config;

use crate::driver::{DevBuf, DevPtr, Gpu, GpuError, Result};
use crate::kernels::{attention_prefill, Kernels};
use crate::launch::{Dims, Launcher};
use crate::selftest::{normals, rel_err, Report};
use crate::weights::{GpuAttention, GpuMatrix};

/// Query tokens per block of `attn_prefill` (QUERY_TILE in the kernel file).
const QUERY_TILE: usize = 16;
/// Keys per pipelined K/V tile (KEY_TILE in the kernel file); key chunks are whole tiles.
const KEY_TILE: usize = 64;
/// Fewest key tiles a chunk takes when the keys are split: each part costs a Q tile load and a 128-row f32 write.
const MIN_CHUNK_TILES: usize = 8;
/// Threads of the row kernels (prep, merge): one warp per (token, head).
const ROW_THREADS: u32 = 256;

/// How `attn_prefill` covers the keys: chunks of `chunk` keys, at most `splits` of them for a query tile.
#[derive(Clone, Copy, Debug, PartialEq)]
struct KeySplit {
    chunk: usize,
    splits: usize,
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
fn key_split(t: usize, start: usize, kv_heads: usize, sm_count: usize) -> KeySplit {
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
pub struct AttnScratch {
    max_tokens: usize,
    sm_count: usize,
    /// bf16 `[token][heads][head_dim]`: normed, rotated queries times 1/sqrt(head_dim).
    q: DevBuf<bf16>,
    /// f32 `[split][token][heads][head_dim]`: a key chunk's unnormalised output.
    part_o: DevBuf<f32>,
    /// f32 `[split][token][heads][2]`: a key chunk's row max (log2 units) and sum of exponentials.
    part_ml: DevBuf<f32>,
}

impl AttnScratch {
    pub fn new(gpu: &Gpu, config: &Config, max_tokens: usize) -> Result<AttnScratch> {
        let c = config;
        // The most part rows any call may need (a call with one chunk writes none).
        let part_rows = (1..=max_tokens)
            .map(|t| match wanted_splits(t, c.num_key_value_heads, gpu.sm_count) {
                1 => 0,
                splits => splits * t,
            })
            .max()
            .unwrap_or(0);
        Ok(AttnScratch {
            max_tokens,
            sm_count: gpu.sm_count,
            q: gpu.alloc(max_tokens * c.q_dim())?,
            part_o: gpu.alloc(part_rows * c.q_dim())?,
            part_ml: gpu.alloc(part_rows * c.num_attention_heads * 2)?,
        })
    }

    /// Queues the attention of `t` tokens at positions `start ..` over the KV cache (bf16 `[position][kv heads]
    /// [head_dim]`, holding at least `start + t` positions; positions below `start` already filled): `proj` is f32
    /// `[t][2 q_dim + 2 kv_dim]` (per head [query | gate], then k, then v), `inv_freq` f32 `[rotary_dim / 2]`, `out`
    /// bf16 `[t][q_dim]` (attention times sigmoid(gate)). Writes the new keys and values into the cache.
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
        k_cache: DevPtr<bf16>,
        v_cache: DevPtr<bf16>,
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
            k_cache,
            v_cache,
        )?;
        let split = key_split(t, start, kv_heads, self.sm_count);
        let group = heads / kv_heads;
        let shared = (group * QUERY_TILE + 4 * KEY_TILE) * head_dim * 2;
        let grid = ((t.div_ceil(QUERY_TILE) * kv_heads) as u32, split.splits as u32, 1);
        attention_prefill::attn_prefill(
            l,
            Dims::new(grid, (group * 32) as u32).shared(shared as u32),
            self.q.ptr(),
            k_cache,
            v_cache,
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

fn bf16_to_f32(v: &[bf16]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

/// Selftest: prep and attention against the CPU twin (rmsnorm, RoPE, `attend` over the bf16 K/V the GPU reads,
/// sigmoid gate), for prompts from the start (t = 1, 50, 300: one query tile, several, a ragged last tile) and after
/// a random odd-length prefix of random keys and values (t = 130 and t = 1: the key range split into chunks).
pub(crate) fn check(gpu: &Gpu, kernels: &Kernels, config: &Config, seed: u64, report: &mut Report) -> Result<()> {
    let c = config;
    let mut rng = Rng::new(seed ^ 0xa77e);
    let (heads, kv_heads, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
    let (q_dim, kv_dim) = (c.q_dim(), c.kv_dim());
    let row = 2 * q_dim + 2 * kv_dim;
    let nan = bf16::NAN;
    let prefix = 1001 + 2 * (rng.next_u64() % 500) as usize;
    let cases = [(1, 0), (50, 0), (300, 0), (130, prefix), (1, prefix)];
    let max_tokens = cases.iter().map(|&(t, _)| t).max().unwrap_or(1);
    let max_len = cases.iter().map(|&(t, start)| t + start).max().unwrap_or(1);

    let scratch = AttnScratch::new(gpu, c, max_tokens)?;
    let q_norm: Vec<f32> = (0..hd).map(|_| 1.0 + 0.2 * rng.normal()).collect();
    let k_norm: Vec<f32> = (0..hd).map(|_| 1.0 + 0.2 * rng.normal()).collect();
    let inv_freq = rope_inv_freq(c.rope_theta, c.rotary_dim());
    // `run` reads only the norms of the layer's weights.
    let no_matrix = || -> Result<GpuMatrix> {
        Ok(GpuMatrix {
            packed: gpu.alloc(0)?,
            scale_bias: gpu.alloc(0)?,
            rows: 0,
            cols: 0,
            bits: 4,
        })
    };
    let weights = GpuAttention {
        qkv: no_matrix()?,
        q_norm: gpu.alloc(hd)?,
        k_norm: gpu.alloc(hd)?,
        o_proj: no_matrix()?,
    };
    gpu.upload(weights.q_norm.ptr(), &q_norm)?;
    gpu.upload(weights.k_norm.ptr(), &k_norm)?;
    let inv_freq_buf = gpu.upload_new(&inv_freq)?;
    let proj_buf = gpu.alloc(max_tokens * row)?;
    let k_cache = gpu.alloc(max_len * kv_dim)?;
    let v_cache = gpu.alloc(max_len * kv_dim)?;
    let out_buf = gpu.alloc(max_tokens * q_dim)?;
    let mut launcher = Launcher::new(gpu, kernels);

    for (t, start) in cases {
        let len = start + t;
        let proj = normals(&mut rng, t * row, 1.0);
        // Random keys and values before `start`, NaN where this call must write.
        let cache_in = |rng: &mut Rng| -> Vec<bf16> {
            let mut v: Vec<bf16> = (0..start * kv_dim).map(|_| bf16::from_f32(rng.normal())).collect();
            v.resize(len * kv_dim, nan);
            v
        };
        let (k_in, v_in) = (cache_in(&mut rng), cache_in(&mut rng));
        gpu.upload(proj_buf.ptr(), &proj)?;
        gpu.upload(k_cache.ptr(), &k_in)?;
        gpu.upload(v_cache.ptr(), &v_in)?;
        gpu.upload(out_buf.ptr(), &vec![nan; t * q_dim])?;
        gpu.upload(scratch.q.ptr(), &vec![nan; t * q_dim])?;
        scratch.run(
            &mut launcher,
            c,
            t,
            start,
            proj_buf.ptr(),
            &weights,
            inv_freq_buf.ptr(),
            k_cache.ptr(),
            v_cache.ptr(),
            out_buf.ptr(),
        )?;
        gpu.sync()?;
        let mut q_gpu = vec![bf16::ZERO; t * q_dim];
        let mut k_gpu = vec![bf16::ZERO; len * kv_dim];
        let mut v_gpu = vec![bf16::ZERO; len * kv_dim];
        let mut out_gpu = vec![bf16::ZERO; t * q_dim];
        gpu.download(scratch.q.ptr(), &mut q_gpu)?;
        gpu.download(k_cache.ptr(), &mut k_gpu)?;
        gpu.download(v_cache.ptr(), &mut v_gpu)?;
        gpu.download(out_buf.ptr(), &mut out_gpu)?;
        let (k_gpu, v_gpu) = (bf16_to_f32(&k_gpu), bf16_to_f32(&v_gpu));

        // CPU twin of the prep: queries (unscaled: `attend` scales), and the whole cache as it should be after.
        let mut q = vec![0.0f32; t * q_dim];
        let mut k_ref = bf16_to_f32(&k_in[..start * kv_dim]);
        let mut v_ref = bf16_to_f32(&v_in[..start * kv_dim]);
        for i in 0..t {
            let src = &proj[i * row..(i + 1) * row];
            for h in 0..heads {
                let qh = &mut q[(i * heads + h) * hd..(i * heads + h + 1) * hd];
                rmsnorm(&src[h * 2 * hd..h * 2 * hd + hd], &q_norm, c.rms_norm_eps, qh);
                rope(qh, start + i, &inv_freq);
            }
            for h in 0..kv_heads {
                let mut k = vec![0.0; hd];
                rmsnorm(
                    &src[2 * q_dim + h * hd..2 * q_dim + (h + 1) * hd],
                    &k_norm,
                    c.rms_norm_eps,
                    &mut k,
                );
                rope(&mut k, start + i, &inv_freq);
                k_ref.extend(k);
            }
            v_ref.extend_from_slice(&src[2 * q_dim + kv_dim..]);
        }
        let q_scaled: Vec<f32> = q.iter().map(|v| v / (hd as f32).sqrt()).collect();
        // Each value is one bf16 rounding of the f32 result (relative error <= 2^-8), so max error / max value
        // <= 3.9e-3 plus f32 noise; the prefix rows must come back as they were.
        let prep_err = rel_err(&bf16_to_f32(&q_gpu), &q_scaled)
            .max(rel_err(&k_gpu, &k_ref))
            .max(rel_err(&v_gpu, &v_ref));
        report.check(
            &format!("attn_prefill_prep t={t} start={start}: q, k and v cache (bf16)"),
            prep_err,
            5e-3,
        );

        // CPU twin of the attention over the K/V the GPU reads (its bf16 cache), with the gate.
        let mut expected = vec![0.0f32; t * q_dim];
        attend(&q, &k_gpu, &v_gpu, start, heads, kv_heads, hd, &mut expected);
        for i in 0..t {
            for h in 0..heads {
                let gate = &proj[i * row + h * 2 * hd + hd..i * row + (h + 1) * 2 * hd];
                for (o, g) in expected[(i * heads + h) * hd..(i * heads + h + 1) * hd]
                    .iter_mut()
                    .zip(gate)
                {
                    *o *= sigmoid(*g);
                }
            }
        }
        // The GPU rounds q and P to bf16 (each <= 2^-8 relative; over many keys the P errors average out) and the
        // output to bf16 (<= 2^-8 of each value): a few 1e-3 of the largest output; a wrong key or mask is O(1).
        let split = key_split(t, start, kv_heads, gpu.sm_count);
        let name = format!(
            "attn_prefill t={t} start={start} ({} key chunk(s)): gated output",
            split.splits
        );
        report.check(&name, rel_err(&bf16_to_f32(&out_gpu), &expected), 1e-2);
    }
    Ok(())
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
