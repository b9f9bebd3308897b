//! The Gated DeltaNet mixer of the prefill, between the input projection and the output projection: the three
//! launches of kernels/deltanet_prefill.cu (chunk-parallel preparation, the sequential state pass, the gated
//! norm), their scratch, and their check against the CPU twin.

use half::{bf16, f16};
use lily_model::cpu::deltanet::CHUNK;
use lily_model::Config;

use crate::driver::{DevBuf, DevPtr, Gpu, Result};
use crate::kernels::{deltanet_prefill, Q8x2};
use crate::launch::{Dims, Launcher};
use crate::weights::GpuGatedDeltaNet;

const THREADS: u32 = 256;
const WARPS_PER_BLOCK: usize = THREADS as usize / 32;

/// Columns of a proj row: q k v (the conv channels), z, b, a.
pub(crate) fn proj_dim(c: &Config) -> usize {
    c.linear_conv_dim() + c.linear_value_dim() + 2 * c.linear_num_value_heads
}

/// Whether cuts after `a` and after `b` tokens of a call fall in the same chunk of it (tokens 64 c + 1 ..= 64 c +
/// 64 end chunk c): the state pass writes at most one cut's state a chunk.
pub(crate) fn cuts_share_a_chunk(a: usize, b: usize) -> bool {
    (a - 1) / CHUNK == (b - 1) / CHUNK
}

/// A snapshot taken inside a call: the conv ring (f32) and the state (f16) as the call's first `tokens` tokens
/// (1 ..= t - 1) leave them, written to `ring` and `state` (laid out as the slot's own).
#[derive(Clone, Copy, Debug)]
pub struct DeltaNetCut {
    pub tokens: usize,
    pub ring: DevPtr<f32>,
    pub state: DevPtr<f16>,
}

/// One call's intermediate values, for up to `max_tokens` tokens (rounded up to whole chunks of 64); the layouts
/// are in deltanet_prefill.cu's top comment.
pub struct DeltaNetScratch {
    pub(crate) max_tokens: usize,
    /// f32 `[key heads][tokens][head dim]`: l2-normed q (times 1/sqrt(dim)) and k.
    pub(crate) q: DevBuf<f32>,
    pub(crate) k: DevBuf<f32>,
    /// f32 `[value heads][tokens][head dim]`: v after the conv, overwritten by the state pass with the output o.
    pub(crate) v_o: DevBuf<f32>,
    /// f32 `[value heads][tokens]`: the cumulative log decay within each chunk, and beta.
    pub(crate) decay: DevBuf<f32>,
    pub(crate) beta: DevBuf<f32>,
    /// f32 `[value heads][chunks][64][64]`: (I + A)^-1 and the intra-chunk attention of each chunk.
    pub(crate) inverse: DevBuf<f32>,
    pub(crate) attn: DevBuf<f32>,
}

impl DeltaNetScratch {
    pub fn new(gpu: &Gpu, config: &Config, max_tokens: usize) -> Result<DeltaNetScratch> {
        let padded = max_tokens.div_ceil(CHUNK) * CHUNK;
        let (key_heads, value_heads) = (config.linear_num_key_heads, config.linear_num_value_heads);
        let dim = config.linear_key_head_dim;
        Ok(DeltaNetScratch {
            max_tokens,
            q: gpu.alloc(key_heads * padded * dim)?,
            k: gpu.alloc(key_heads * padded * dim)?,
            v_o: gpu.alloc(value_heads * padded * dim)?,
            decay: gpu.alloc(value_heads * padded)?,
            beta: gpu.alloc(value_heads * padded)?,
            inverse: gpu.alloc(value_heads * padded * CHUNK)?,
            attn: gpu.alloc(value_heads * padded * CHUNK)?,
        })
    }

    /// Queues the mixer for tokens at positions `start .. start + t`: `proj` f32 `[t][proj row]` in, `ring` (conv
    /// inputs, slot = position % taps) and `state` (f16 `[value heads][k dim][v dim]`) read and left as decode
    /// would leave them, `out` bf16 `[t][linear value dim]`: the gated norm of each head's output, the input of
    /// the output projection, also coded into `codes` unless that is [`Q8x2::NONE`]. At each of `cuts` (at most
    /// two, ascending, inside the call, in different chunks: see [`cuts_share_a_chunk`]) the state after its first
    /// `cut.tokens` tokens is copied out in the pass. Calls of up to `deltanet_short_max_tokens` tokens run the
    /// recurrence token by token (`deltanet_prefill_short`), longer ones the chunked form.
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &self,
        l: &mut Launcher,
        config: &Config,
        t: usize,
        start: usize,
        proj: DevPtr<f32>,
        ring: DevPtr<f32>,
        state: DevPtr<f16>,
        weights: &GpuGatedDeltaNet,
        out: DevPtr<bf16>,
        codes: Q8x2,
        cuts: &[DeltaNetCut],
    ) -> Result<()> {
        assert!(
            t >= 1 && t <= self.max_tokens,
            "a DeltaNet prefill call takes 1 ..= {} tokens",
            self.max_tokens
        );
        assert!(
            cuts.len() <= 2
                && cuts.iter().all(|cut| cut.tokens >= 1 && cut.tokens < t)
                && cuts
                    .windows(2)
                    .all(|w| w[0].tokens < w[1].tokens && !cuts_share_a_chunk(w[0].tokens, w[1].tokens)),
            "cuts inside a DeltaNet prefill call of {t} tokens: at most two, in different chunks: {cuts:?}"
        );
        let cut = |i: usize| match cuts.get(i) {
            Some(cut) => (cut.tokens as i32, cut.ring, cut.state),
            None => (0, DevPtr::NULL, DevPtr::NULL),
        };
        let ((cut_at, cut_ring, cut_state), (cut2_at, cut2_ring, cut2_state)) = (cut(0), cut(1));
        let (t32, start32) = (t as i32, start as i32);
        let value_heads = config.linear_num_value_heads;
        if t <= l.kernels.constant("deltanet_short_max_tokens") {
            // A short call: the recurrence token by token, in one launch.
            deltanet_prefill::deltanet_prefill_short(
                l,
                Dims::new(
                    (value_heads as u32, l.kernels.constant("deltanet_short_split") as u32, 1),
                    THREADS,
                ),
                proj,
                t32,
                start32,
                ring,
                weights.conv1d.ptr(),
                weights.a_log.ptr(),
                weights.dt_bias.ptr(),
                self.v_o.ptr(),
                state,
                cut_at,
                cut_state,
                cut_ring,
                cut2_at,
                cut2_state,
                cut2_ring,
            )?;
        } else {
            let chunks_shared = l.kernels.constant("deltanet_chunks_shared_bytes") as u32;
            let state_shared = l.kernels.constant("deltanet_state_shared_bytes") as u32;
            let split = l.kernels.constant("deltanet_state_split") as u32;
            deltanet_prefill::deltanet_prefill_chunks(
                l,
                Dims::new(
                    (t.div_ceil(CHUNK) as u32, config.linear_num_key_heads as u32, 1),
                    THREADS,
                )
                .shared(chunks_shared),
                proj,
                t32,
                start32,
                ring,
                weights.conv1d.ptr(),
                weights.a_log.ptr(),
                weights.dt_bias.ptr(),
                self.q.ptr(),
                self.k.ptr(),
                self.v_o.ptr(),
                self.decay.ptr(),
                self.beta.ptr(),
                self.inverse.ptr(),
                self.attn.ptr(),
                cut_at,
                cut_ring,
                cut2_at,
                cut2_ring,
            )?;
            deltanet_prefill::deltanet_prefill_state(
                l,
                Dims::new((value_heads as u32, split, 1), THREADS).shared(state_shared),
                self.q.ptr(),
                self.k.ptr(),
                self.v_o.ptr(),
                self.decay.ptr(),
                self.beta.ptr(),
                self.inverse.ptr(),
                self.attn.ptr(),
                t32,
                state,
                cut_at,
                cut_state,
                cut2_at,
                cut2_state,
            )?;
        }
        deltanet_prefill::deltanet_prefill_norm(
            l,
            Dims::linear((t * value_heads).div_ceil(WARPS_PER_BLOCK) as u32, THREADS),
            self.v_o.ptr(),
            proj,
            weights.norm.ptr(),
            t32,
            start32,
            ring,
            out,
            codes,
        )
    }
}
