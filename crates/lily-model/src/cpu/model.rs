//! The forward pass on the CPU, f32 throughout, on the 4-bit weights in place.
//!
//! Per layer: `h += mixer(norm1(h)); h += moe(norm2(h))`, the mixer being a Gated DeltaNet or gated full
//! attention; then the final norm and lm_head. Prefill runs the prompt in slices of [`PREFILL_SLICE`] tokens with
//! the chunked DeltaNet; decode runs one token with the DeltaNet recurrence. All state is allocated up front.

use rayon::prelude::*;

use super::attention::{attend, rope};
use super::decode::DecodeRow;
use super::deltanet::{self, conv_sequence, l2norm};
use super::linalg::{qmatmul, qmatmuls, rmsnorm, rmsnorm_in_place, sigmoid, silu, softplus};
use super::moe::{moe_decode, moe_forward, MoeScratch};
use super::simd::QInput;
pub use crate::backend::ForwardError;
use crate::config::Config;
use crate::weights::{Attention, GatedDeltaNet, Mixer, Weights};

/// Prompt tokens processed per pass through the layers (bounds activation memory; a multiple of the DeltaNet
/// chunk so that slices do not split chunks).
pub const PREFILL_SLICE: usize = 256;

/// One sequence's state: KV cache of the full-attention layers, conv and recurrent state of the DeltaNet layers.
/// A clone is an independent copy of the sequence (the batching backend forks a prompt's state this way).
#[derive(Clone)]
pub struct State {
    /// Tokens already processed (the next token's position).
    pub position: usize,
    pub max_context: usize,
    /// The smallest routing margin (`moe::route_margin`) of the last prefill or decode step, over its tokens and
    /// layers: below the precision another implementation reaches, it may choose other experts.
    pub route_margin: f32,
    /// Per full-attention layer: keys and values, `[max_context][kv_heads * head_dim]`.
    pub(super) k_cache: Vec<Vec<f32>>,
    pub(super) v_cache: Vec<Vec<f32>>,
    /// Per DeltaNet layer: the last `taps - 1` conv inputs, `[taps - 1][conv_dim]`.
    pub(super) conv: Vec<Vec<f32>>,
    /// Per DeltaNet layer: `[value_heads][key_dim][value_dim]`.
    pub(super) recurrent: Vec<Vec<f32>>,
    pub(super) act: Activations,
}

/// A sequence's state without its buffers for the next step ([`State::save`]): what a prefix-cache snapshot keeps.
#[derive(Clone)]
pub struct SavedState {
    pub position: usize,
    k_cache: Vec<Vec<f32>>,
    v_cache: Vec<Vec<f32>>,
    conv: Vec<Vec<f32>>,
    recurrent: Vec<Vec<f32>>,
}

impl SavedState {
    /// Bytes of state it holds.
    pub fn bytes(&self) -> usize {
        let floats: usize = [&self.k_cache, &self.v_cache, &self.conv, &self.recurrent]
            .iter()
            .flat_map(|parts| parts.iter())
            .map(Vec::len)
            .sum();
        floats * 4
    }
}

/// Activation buffers for up to `PREFILL_SLICE` tokens.
#[derive(Clone)]
pub(super) struct Activations {
    pub(super) hidden: Vec<f32>,
    pub(super) normed: Vec<f32>,
    pub(super) mixer_out: Vec<f32>,
    pub(super) moe_out: Vec<f32>,
    pub(super) projected: Vec<f32>,
    pub(super) conv_out: Vec<f32>,
    pub(super) z: Vec<f32>,
    pub(super) beta: Vec<f32>,
    pub(super) decay: Vec<f32>,
    pub(super) core: Vec<f32>,
    pub(super) keys: Vec<f32>,
    pub(super) values: Vec<f32>,
    pub(super) queries: Vec<f32>,
    pub(super) moe: MoeScratch,
    /// The input of a decode step's products, quantized for 4-bit and for 8-bit matrices.
    pub(super) x4: QInput,
    pub(super) x8: QInput,
}

impl State {
    pub fn new(config: &Config, max_context: usize) -> State {
        let c = config;
        let n = PREFILL_SLICE;
        let zeros = |len: usize| vec![0.0f32; len];
        State {
            position: 0,
            max_context,
            route_margin: f32::INFINITY,
            k_cache: (0..c.num_full_layers())
                .map(|_| zeros(max_context * c.kv_dim()))
                .collect(),
            v_cache: (0..c.num_full_layers())
                .map(|_| zeros(max_context * c.kv_dim()))
                .collect(),
            conv: (0..c.num_linear_layers())
                .map(|_| zeros((c.linear_conv_kernel_dim - 1) * c.linear_conv_dim()))
                .collect(),
            recurrent: (0..c.num_linear_layers())
                .map(|_| zeros(c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim))
                .collect(),
            act: Activations {
                hidden: zeros(n * c.hidden_size),
                normed: zeros(n * c.hidden_size),
                mixer_out: zeros(n * c.hidden_size),
                moe_out: zeros(n * c.hidden_size),
                projected: zeros(n * c.linear_conv_dim().max(2 * c.q_dim())),
                conv_out: zeros(n * c.linear_conv_dim()),
                z: zeros(n * c.linear_value_dim()),
                beta: zeros(n * c.linear_num_value_heads),
                decay: zeros(n * c.linear_num_value_heads),
                core: zeros(n * c.linear_value_dim().max(c.q_dim())),
                keys: zeros(n * c.kv_dim()),
                values: zeros(n * c.kv_dim()),
                queries: zeros(n * c.q_dim()),
                moe: MoeScratch::new(c),
                x4: QInput::new(),
                x8: QInput::new(),
            },
        }
    }

    /// Makes the KV cache hold `max_context` positions (growing or shrinking it, never below the tokens already
    /// held), keeping the sequence.
    pub fn set_max_context(&mut self, max_context: usize) {
        let max_context = max_context.max(self.position);
        for cache in self.k_cache.iter_mut().chain(self.v_cache.iter_mut()) {
            let per_token = cache.len() / self.max_context.max(1);
            cache.resize(max_context * per_token, 0.0);
            cache.shrink_to_fit();
        }
        self.max_context = max_context;
    }

    /// A copy of the sequence: its keys and values up to `position` and its DeltaNet state (no activations).
    pub fn save(&self) -> SavedState {
        let kv = |caches: &[Vec<f32>]| -> Vec<Vec<f32>> {
            caches
                .iter()
                .map(|cache| {
                    let per_token = cache.len() / self.max_context.max(1);
                    cache[..self.position * per_token].to_vec()
                })
                .collect()
        };
        SavedState {
            position: self.position,
            k_cache: kv(&self.k_cache),
            v_cache: kv(&self.v_cache),
            conv: self.conv.clone(),
            recurrent: self.recurrent.clone(),
        }
    }

    /// Replaces the sequence with `saved`, growing the KV cache to hold it if needed.
    pub fn load(&mut self, saved: &SavedState) {
        if self.max_context < saved.position {
            self.set_max_context(saved.position);
        }
        for (cache, from) in self
            .k_cache
            .iter_mut()
            .zip(&saved.k_cache)
            .chain(self.v_cache.iter_mut().zip(&saved.v_cache))
        {
            cache[..from.len()].copy_from_slice(from);
        }
        for (state, from) in self
            .conv
            .iter_mut()
            .zip(&saved.conv)
            .chain(self.recurrent.iter_mut().zip(&saved.recurrent))
        {
            state.copy_from_slice(from);
        }
        self.position = saved.position;
    }

    /// Forgets the sequence (the buffers are kept).
    pub fn reset(&mut self) {
        self.position = 0;
        self.conv.iter_mut().for_each(|s| s.fill(0.0));
        self.recurrent.iter_mut().for_each(|s| s.fill(0.0));
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Pass {
    Prefill,
    Decode,
}

pub struct CpuModel {
    pub weights: Weights,
    pub(super) inv_freq: Vec<f32>,
    /// For each layer, its index among the layers of its kind (into the KV cache or the DeltaNet state).
    pub(super) slot: Vec<usize>,
}

impl CpuModel {
    pub fn new(weights: Weights) -> CpuModel {
        let c = &weights.config;
        let inv_freq = c.rope_inv_freq();
        let slot = c.layer_slots();
        CpuModel {
            weights,
            inv_freq,
            slot,
        }
    }

    pub fn config(&self) -> &Config {
        &self.weights.config
    }

    pub fn new_state(&self, max_context: usize) -> State {
        State::new(self.config(), max_context)
    }

    /// Runs a prompt (continuing the sequence in `state`) and writes the logits of its last token.
    pub fn prefill(&self, state: &mut State, tokens: &[u32], logits: &mut [f32]) -> Result<(), ForwardError> {
        self.prefill_inner(state, tokens, false, |_, row| logits.copy_from_slice(row))
    }

    /// Runs a prompt and returns the logits of every position, `[tokens][vocab]` (for tests and scoring).
    pub fn prefill_all_logits(&self, state: &mut State, tokens: &[u32]) -> Result<Vec<f32>, ForwardError> {
        let vocab = self.config().vocab_size;
        let mut all = vec![0.0; tokens.len() * vocab];
        self.prefill_inner(state, tokens, true, |t, row| {
            all[t * vocab..(t + 1) * vocab].copy_from_slice(row)
        })?;
        Ok(all)
    }

    fn prefill_inner(
        &self,
        state: &mut State,
        tokens: &[u32],
        every_position: bool,
        mut emit: impl FnMut(usize, &[f32]),
    ) -> Result<(), ForwardError> {
        if tokens.is_empty() {
            return Err(ForwardError::EmptyPrompt);
        }
        self.check(state, tokens)?;
        let (vocab, h) = (self.config().vocab_size, self.config().hidden_size);
        // The logits of up to LOGIT_TOKENS positions at a time (one product for all of them).
        const LOGIT_TOKENS: usize = 16;
        let mut rows = vec![0.0; vocab * if every_position { LOGIT_TOKENS } else { 1 }];
        state.route_margin = f32::INFINITY;
        for (slice_index, slice) in tokens.chunks(PREFILL_SLICE).enumerate() {
            let base = slice_index * PREFILL_SLICE;
            self.forward(state, slice, Pass::Prefill);
            let wanted = if every_position {
                0..slice.len()
            } else if base + slice.len() == tokens.len() {
                slice.len() - 1..slice.len()
            } else {
                0..0
            };
            for first in wanted.clone().step_by(LOGIT_TOKENS) {
                let n = LOGIT_TOKENS.min(wanted.end - first);
                let logits = &mut rows[..n * vocab];
                self.lm_head(&state.act.normed[first * h..(first + n) * h], logits);
                for (t, row) in logits.chunks_exact(vocab).enumerate() {
                    emit(base + first + t, row);
                }
            }
        }
        Ok(())
    }

    /// One decode step: appends `token` to the sequence and writes the next-token logits.
    pub fn decode(&self, state: &mut State, token: u32, logits: &mut [f32]) -> Result<(), ForwardError> {
        self.check(state, &[token])?;
        if self.decode_step(state, token, logits) {
            return Ok(());
        }
        self.decode_in_regions(state, token, logits)
    }

    /// One decode step of several sequences at once (the rows' states distinct): appends each row's token to its
    /// sequence and writes its next-token logits, exactly as [`CpuModel::decode`] of each alone would. Every row is
    /// checked before any runs, so a bad row changes nothing. The products read each matrix once for all the rows
    /// (and each expert once for the rows routed to it), so a step of many rows costs little more than one.
    pub fn decode_rows(&self, rows: &mut [DecodeRow]) -> Result<(), ForwardError> {
        for row in rows.iter() {
            self.check(row.state, &[row.token])?;
        }
        if self.decode_rows_step(rows) {
            return Ok(());
        }
        for row in rows.iter_mut() {
            self.decode_in_regions(row.state, row.token, row.logits)?;
        }
        Ok(())
    }

    /// [`CpuModel::decode`] as a sequence of the pool's fork-join regions, one per step of the layers (the same
    /// results: a check of the decode step's team of threads).
    pub fn decode_in_regions(&self, state: &mut State, token: u32, logits: &mut [f32]) -> Result<(), ForwardError> {
        self.check(state, &[token])?;
        state.route_margin = f32::INFINITY;
        self.forward(state, &[token], Pass::Decode);
        let h = self.config().hidden_size;
        self.lm_head(&state.act.normed[..h], logits);
        Ok(())
    }

    fn check(&self, state: &State, tokens: &[u32]) -> Result<(), ForwardError> {
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= self.config().vocab_size) {
            return Err(ForwardError::BadToken(bad));
        }
        let needed = state.position + tokens.len();
        if needed > state.max_context {
            return Err(ForwardError::ContextFull {
                needed,
                max_context: state.max_context,
            });
        }
        Ok(())
    }

    fn lm_head(&self, normed: &[f32], logits: &mut [f32]) {
        qmatmul(self.weights.lm_head.view(), normed, logits);
    }

    /// The whole forward pass for up to `PREFILL_SLICE` tokens; leaves the final-normed hidden states in
    /// `state.act.normed` and advances `state.position`.
    fn forward(&self, state: &mut State, tokens: &[u32], pass: Pass) {
        let c = self.config();
        let (h, n) = (c.hidden_size, tokens.len());
        let w = &self.weights;
        let embed = w.embed_tokens.view();
        state.act.hidden[..n * h]
            .par_chunks_mut(h)
            .zip(tokens)
            .for_each(|(row, &token)| embed.dequantize_row(token as usize, row));
        for (l, layer) in w.layers.iter().enumerate() {
            rmsnorm(
                &state.act.hidden[..n * h],
                &layer.input_layernorm,
                c.rms_norm_eps,
                &mut state.act.normed[..n * h],
            );
            match &layer.mixer {
                Mixer::Linear(deltanet) => self.gated_deltanet(deltanet, self.slot[l], state, n, pass),
                Mixer::Full(attn) => self.attention(attn, self.slot[l], state, n),
            }
            add(&mut state.act.hidden[..n * h], &state.act.mixer_out[..n * h]);
            rmsnorm(
                &state.act.hidden[..n * h],
                &layer.post_attention_layernorm,
                c.rms_norm_eps,
                &mut state.act.normed[..n * h],
            );
            let act = &mut state.act;
            let (x, out) = (&act.normed[..n * h], &mut act.moe_out[..n * h]);
            let margin = match n {
                1 => moe_decode(&layer.moe, c.num_experts, c.num_experts_per_tok, x, out, &mut act.moe),
                _ => moe_forward(&layer.moe, c.num_experts, c.num_experts_per_tok, x, out),
            };
            state.route_margin = state.route_margin.min(margin);
            add(&mut state.act.hidden[..n * h], &state.act.moe_out[..n * h]);
        }
        rmsnorm(
            &state.act.hidden[..n * h],
            &w.final_norm,
            c.rms_norm_eps,
            &mut state.act.normed[..n * h],
        );
        state.position += n;
    }

    fn gated_deltanet(&self, deltanet: &GatedDeltaNet, slot: usize, state: &mut State, n: usize, pass: Pass) {
        let c = self.config();
        let (h, conv_dim) = (c.hidden_size, c.linear_conv_dim());
        let (nk, nv, dk, dv) = (
            c.linear_num_key_heads,
            c.linear_num_value_heads,
            c.linear_key_head_dim,
            c.linear_value_head_dim,
        );
        let key_dim = c.linear_key_dim();
        let act = &mut state.act;
        let x = &act.normed[..n * h];
        qmatmuls(
            x,
            &mut [
                (deltanet.in_proj_qkv.view(), &mut act.projected[..n * conv_dim]),
                (deltanet.in_proj_z.view(), &mut act.z[..n * nv * dv]),
                (deltanet.in_proj_b.view(), &mut act.beta[..n * nv]),
                (deltanet.in_proj_a.view(), &mut act.decay[..n * nv]),
            ],
        );
        conv_sequence(
            &act.projected[..n * conv_dim],
            &mut state.conv[slot],
            &deltanet.conv1d,
            c.linear_conv_kernel_dim,
            conv_dim,
            &mut act.conv_out[..n * conv_dim],
        );
        let q_scale = 1.0 / (dk as f32).sqrt();
        act.conv_out[..n * conv_dim]
            .par_chunks_mut(conv_dim)
            .zip(act.beta[..n * nv].par_chunks_mut(nv))
            .zip(act.decay[..n * nv].par_chunks_mut(nv))
            .for_each(|((row, beta), decay)| {
                for head in row[..2 * key_dim].chunks_exact_mut(dk) {
                    l2norm(head);
                }
                row[..key_dim].iter_mut().for_each(|v| *v *= q_scale);
                for j in 0..nv {
                    beta[j] = sigmoid(beta[j]);
                    decay[j] = -deltanet.a_log[j].exp() * softplus(decay[j] + deltanet.dt_bias[j]);
                }
            });
        let conv_out = &act.conv_out[..n * conv_dim];
        let (beta, decay) = (&act.beta[..n * nv], &act.decay[..n * nv]);
        let heads_per_key = nv / nk;
        let core = &mut act.core[..n * nv * dv];
        let recurrent = &mut state.recurrent[slot];
        let q_of = |t: usize, kh: usize| &conv_out[t * conv_dim + kh * dk..t * conv_dim + (kh + 1) * dk];
        let k_of =
            |t: usize, kh: usize| &conv_out[t * conv_dim + key_dim + kh * dk..t * conv_dim + key_dim + (kh + 1) * dk];
        let v_of = |t: usize, head: usize| {
            &conv_out[t * conv_dim + 2 * key_dim + head * dv..t * conv_dim + 2 * key_dim + (head + 1) * dv]
        };
        // Each value head is independent: its own state block and its own column block of `core`.
        match pass {
            Pass::Decode => {
                assert_eq!(n, 1, "a decode step runs one token");
                // One token: each head writes its block of `core` in place.
                recurrent
                    .par_chunks_mut(dk * dv)
                    .zip(core.par_chunks_mut(dv))
                    .enumerate()
                    .for_each(|(head, (s, out))| {
                        let kh = head / heads_per_key;
                        deltanet::recurrent_step(
                            q_of(0, kh),
                            k_of(0, kh),
                            v_of(0, head),
                            decay[head],
                            beta[head],
                            s,
                            out,
                        );
                    });
            }
            Pass::Prefill => {
                let head_outputs: Vec<Vec<f32>> = recurrent
                    .par_chunks_mut(dk * dv)
                    .enumerate()
                    .map(|(head, s)| {
                        let kh = head / heads_per_key;
                        let q: Vec<f32> = (0..n).flat_map(|t| q_of(t, kh).iter().copied()).collect();
                        let k: Vec<f32> = (0..n).flat_map(|t| k_of(t, kh).iter().copied()).collect();
                        let v: Vec<f32> = (0..n).flat_map(|t| v_of(t, head).iter().copied()).collect();
                        let g: Vec<f32> = (0..n).map(|t| decay[t * nv + head]).collect();
                        let b: Vec<f32> = (0..n).map(|t| beta[t * nv + head]).collect();
                        let mut out = vec![0.0; n * dv];
                        deltanet::chunked(&q, &k, &v, &g, &b, s, &mut out);
                        out
                    })
                    .collect();
                core.par_chunks_mut(nv * dv).enumerate().for_each(|(t, row)| {
                    for (out, head) in head_outputs.iter().zip(row.chunks_exact_mut(dv)) {
                        head.copy_from_slice(&out[t * dv..(t + 1) * dv]);
                    }
                });
            }
        }
        // Gated RMSNorm per value head: w * rmsnorm(o) * silu(z).
        core.par_chunks_mut(nv * dv)
            .zip(act.z[..n * nv * dv].par_chunks(nv * dv))
            .for_each(|(row, z)| {
                rmsnorm_in_place(row, &deltanet.norm, c.rms_norm_eps);
                for (o, z) in row.iter_mut().zip(z) {
                    *o *= silu(*z);
                }
            });
        qmatmul(deltanet.out_proj.view(), core, &mut act.mixer_out[..n * h]);
    }

    fn attention(&self, attn: &Attention, slot: usize, state: &mut State, n: usize) {
        let c = self.config();
        let (h, hd, heads, kv_heads) = (c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads);
        let (q_dim, kv_dim) = (c.q_dim(), c.kv_dim());
        let start = state.position;
        let act = &mut state.act;
        let x = &act.normed[..n * h];
        qmatmuls(
            x,
            &mut [
                (attn.q_proj.view(), &mut act.projected[..n * 2 * q_dim]),
                (attn.k_proj.view(), &mut act.keys[..n * kv_dim]),
                (attn.v_proj.view(), &mut act.values[..n * kv_dim]),
            ],
        );
        let projected = &act.projected[..n * 2 * q_dim];
        act.queries[..n * q_dim]
            .par_chunks_mut(q_dim)
            .zip(act.keys[..n * kv_dim].par_chunks_mut(kv_dim))
            .enumerate()
            .for_each(|(t, (queries, keys))| {
                let position = start + t;
                for (head, q) in queries.chunks_exact_mut(hd).enumerate() {
                    let src = &projected[t * 2 * q_dim + head * 2 * hd..t * 2 * q_dim + head * 2 * hd + hd];
                    rmsnorm(src, &attn.q_norm, c.rms_norm_eps, q);
                    rope(q, position, &self.inv_freq);
                }
                for head in keys.chunks_exact_mut(hd) {
                    rmsnorm_in_place(head, &attn.k_norm, c.rms_norm_eps);
                    rope(head, position, &self.inv_freq);
                }
            });
        let (k_cache, v_cache) = (&mut state.k_cache[slot], &mut state.v_cache[slot]);
        k_cache[start * kv_dim..(start + n) * kv_dim].copy_from_slice(&act.keys[..n * kv_dim]);
        v_cache[start * kv_dim..(start + n) * kv_dim].copy_from_slice(&act.values[..n * kv_dim]);
        let core = &mut act.core[..n * q_dim];
        attend(
            &act.queries[..n * q_dim],
            &k_cache[..(start + n) * kv_dim],
            &v_cache[..(start + n) * kv_dim],
            start,
            heads,
            kv_heads,
            hd,
            core,
        );
        core.par_chunks_mut(q_dim)
            .zip(act.projected[..n * 2 * q_dim].par_chunks(2 * q_dim))
            .for_each(|(row, projected)| {
                for (head, o) in row.chunks_exact_mut(hd).enumerate() {
                    let gate = &projected[head * 2 * hd + hd..(head + 1) * 2 * hd];
                    for (v, g) in o.iter_mut().zip(gate) {
                        *v *= sigmoid(*g);
                    }
                }
            });
        qmatmul(attn.o_proj.view(), core, &mut act.mixer_out[..n * h]);
    }
}

/// `acc += x`, in parallel blocks for a prompt's rows.
fn add(acc: &mut [f32], x: &[f32]) {
    acc.par_chunks_mut(ELEMENTWISE_BLOCK)
        .zip(x.par_chunks(ELEMENTWISE_BLOCK))
        .for_each(|(acc, x)| acc.iter_mut().zip(x).for_each(|(a, b)| *a += b));
}

/// Values per task of the elementwise steps run in parallel (a decode step's one row is one task, run in place).
const ELEMENTWISE_BLOCK: usize = 16 * 1024;
