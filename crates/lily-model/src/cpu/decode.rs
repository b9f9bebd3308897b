//! One decode step on the CPU, run by a [`team`] of the pool's threads: the same forward pass as a prompt of one
//! token (the same operations in the same order, so the same results), as a list of steps that every thread
//! executes, the products split into tasks of rows, the DeltaNet into tasks of key heads, attention into tasks of
//! query heads, the short row-wise steps (norms, quantizing an input, routing) on one thread.

use super::attention::{attend_head, rope};
use super::deltanet::{decode_key_head, DecodeInputs};
use super::linalg::{rmsnorm_row, rmsnorm_row_in_place, sigmoid, team_matvecs, TeamMatVec};
use super::model::{CpuModel, State};
use super::moe::{team_moe_decode, MoeParts};
use super::simd::QInput;
use super::team::{self, Shared, Team};
use crate::quant::QMatrix;
use crate::weights::{Attention, GatedDeltaNet, Mixer};

/// A sequence's buffers as the team shares them (a decode step reads and writes the first row of each activation).
struct Buffers<'a> {
    hidden: Shared<'a, [f32]>,
    normed: Shared<'a, [f32]>,
    mixer_out: Shared<'a, [f32]>,
    moe_out: Shared<'a, [f32]>,
    projected: Shared<'a, [f32]>,
    conv_out: Shared<'a, [f32]>,
    z: Shared<'a, [f32]>,
    beta: Shared<'a, [f32]>,
    decay: Shared<'a, [f32]>,
    core: Shared<'a, [f32]>,
    keys: Shared<'a, [f32]>,
    values: Shared<'a, [f32]>,
    queries: Shared<'a, [f32]>,
    x4: Shared<'a, QInput>,
    x8: Shared<'a, QInput>,
    moe: MoeParts<'a>,
    conv: Vec<Shared<'a, [f32]>>,
    recurrent: Vec<Shared<'a, [f32]>>,
    k_cache: Vec<Shared<'a, [f32]>>,
    v_cache: Vec<Shared<'a, [f32]>>,
    logits: Shared<'a, [f32]>,
    route_margin: Shared<'a, f32>,
}

impl<'a> Buffers<'a> {
    fn new(state: &'a mut State, logits: &'a mut [f32]) -> Buffers<'a> {
        let act = &mut state.act;
        let all = |buffers: &'a mut Vec<Vec<f32>>| buffers.iter_mut().map(|b| Shared::new(&mut b[..])).collect();
        Buffers {
            hidden: Shared::new(&mut act.hidden[..]),
            normed: Shared::new(&mut act.normed[..]),
            mixer_out: Shared::new(&mut act.mixer_out[..]),
            moe_out: Shared::new(&mut act.moe_out[..]),
            projected: Shared::new(&mut act.projected[..]),
            conv_out: Shared::new(&mut act.conv_out[..]),
            z: Shared::new(&mut act.z[..]),
            beta: Shared::new(&mut act.beta[..]),
            decay: Shared::new(&mut act.decay[..]),
            core: Shared::new(&mut act.core[..]),
            keys: Shared::new(&mut act.keys[..]),
            values: Shared::new(&mut act.values[..]),
            queries: Shared::new(&mut act.queries[..]),
            x4: Shared::new(&mut act.x4),
            x8: Shared::new(&mut act.x8),
            moe: act.moe.parts(),
            conv: all(&mut state.conv),
            recurrent: all(&mut state.recurrent),
            k_cache: all(&mut state.k_cache),
            v_cache: all(&mut state.v_cache),
            logits: Shared::new(logits),
            route_margin: Shared::new(&mut state.route_margin),
        }
    }

    /// Quantizes `x` into `x4` and `x8` for the bit widths of `matrices`.
    ///
    /// # Safety
    /// On one thread while the others wait (in [`Team::single`]).
    unsafe fn quantize_for(&self, x: &[f32], matrices: &[&QMatrix]) {
        for (bits, input) in [(4, self.x4), (8, self.x8)] {
            if matrices.iter().any(|m| m.bits == bits) {
                unsafe { input.get() }.quantize(x, bits);
            }
        }
    }

    /// The inputs as quantized by the last [`Buffers::quantize_for`].
    ///
    /// # Safety
    /// No thread quantizes until the next barrier.
    unsafe fn inputs(&self) -> (&'a QInput, &'a QInput) {
        unsafe { (self.x4.get(), self.x8.get()) }
    }
}

/// `acc += x`.
fn add(acc: &mut [f32], x: &[f32]) {
    acc.iter_mut().zip(x).for_each(|(a, b)| *a += b);
}

impl CpuModel {
    /// One decode step (see the module comment): appends `token` to the sequence and writes the next-token logits.
    /// Returns false, changing nothing, when another team is running (see [`team::try_run`]).
    pub(super) fn decode_step(&self, state: &mut State, token: u32, logits: &mut [f32]) -> bool {
        let c = self.config();
        let w = &self.weights;
        let (h, eps) = (c.hidden_size, c.rms_norm_eps);
        let position = state.position;
        let b = Buffers::new(state, logits);
        // SAFETY (every access to `b` below): the team's steps follow the rules of `Shared`: a step of one thread
        // (`single`) writes while the others wait, a parallel step writes disjoint parts, and barriers separate
        // writes from later reads.
        let ran = team::try_run(|team| unsafe {
            let mut margin = f32::INFINITY;
            for (l, layer) in w.layers.iter().enumerate() {
                team.single(|| {
                    let hidden = b.hidden.part(0, h);
                    if l == 0 {
                        w.embed_tokens.view().dequantize_row(token as usize, hidden);
                    } else {
                        add(hidden, b.moe_out.part(0, h));
                    }
                    let normed = b.normed.part(0, h);
                    rmsnorm_row(hidden, &layer.input_layernorm, eps, normed);
                    let matrices = match &layer.mixer {
                        Mixer::Linear(d) => [&d.in_proj_qkv, &d.in_proj_z, &d.in_proj_b, &d.in_proj_a],
                        Mixer::Full(a) => [&a.q_proj, &a.k_proj, &a.v_proj, &a.v_proj],
                    };
                    b.quantize_for(normed, &matrices);
                });
                match &layer.mixer {
                    Mixer::Linear(deltanet) => self.team_deltanet(team, deltanet, self.slot[l], &b),
                    Mixer::Full(attn) => self.team_attention(team, attn, self.slot[l], position, &b),
                }
                team.single(|| {
                    let hidden = b.hidden.part(0, h);
                    add(hidden, b.mixer_out.part(0, h));
                    let normed = b.normed.part(0, h);
                    rmsnorm_row(hidden, &layer.post_attention_layernorm, eps, normed);
                    let m = &layer.moe;
                    let matrices = [
                        &m.router,
                        &m.shared_expert_gate,
                        &m.shared_gate,
                        &m.shared_up,
                        &m.experts_gate,
                        &m.experts_up,
                    ];
                    b.quantize_for(normed, &matrices);
                });
                let (x4, x8) = b.inputs();
                let (experts, top_k) = (c.num_experts, c.num_experts_per_tok);
                let m = team_moe_decode(team, &layer.moe, experts, top_k, x4, x8, &b.moe, b.moe_out.sub(0, h));
                margin = margin.min(m);
            }
            team.single(|| {
                let hidden = b.hidden.part(0, h);
                add(hidden, b.moe_out.part(0, h));
                let normed = b.normed.part(0, h);
                rmsnorm_row(hidden, &w.final_norm, eps, normed);
                b.quantize_for(normed, &[&w.lm_head]);
                *b.route_margin.get() = margin;
            });
            let (x4, x8) = b.inputs();
            let x = if w.lm_head.bits == 4 { x4 } else { x8 };
            let product = TeamMatVec {
                w: w.lm_head.view(),
                x,
                out: b.logits,
            };
            team_matvecs(team, &[product]);
        });
        if ran {
            state.position += 1;
        }
        ran
    }

    /// The Gated DeltaNet of one token: its projections, the heads in tasks of key heads ([`decode_key_head`]),
    /// the output projection.
    ///
    /// # Safety
    /// Called by every thread of the team, `b.x4` and `b.x8` holding the normed input quantized for the
    /// projections.
    unsafe fn team_deltanet(&self, team: &Team, deltanet: &GatedDeltaNet, slot: usize, b: &Buffers) {
        let c = self.config();
        let (nk, nv, dv) = (
            c.linear_num_key_heads,
            c.linear_num_value_heads,
            c.linear_value_head_dim,
        );
        let conv_dim = c.linear_conv_dim();
        unsafe {
            let (x4, x8) = b.inputs();
            let input = |m: &QMatrix| if m.bits == 4 { x4 } else { x8 };
            team_matvecs(
                team,
                &[
                    TeamMatVec {
                        w: deltanet.in_proj_qkv.view(),
                        x: input(&deltanet.in_proj_qkv),
                        out: b.projected.sub(0, conv_dim),
                    },
                    TeamMatVec {
                        w: deltanet.in_proj_z.view(),
                        x: input(&deltanet.in_proj_z),
                        out: b.z.sub(0, nv * dv),
                    },
                    TeamMatVec {
                        w: deltanet.in_proj_b.view(),
                        x: input(&deltanet.in_proj_b),
                        out: b.beta.sub(0, nv),
                    },
                    TeamMatVec {
                        w: deltanet.in_proj_a.view(),
                        x: input(&deltanet.in_proj_a),
                        out: b.decay.sub(0, nv),
                    },
                ],
            );
            let inputs = DecodeInputs {
                weights: deltanet,
                key_heads: nk,
                value_heads: nv,
                dk: c.linear_key_head_dim,
                dv,
                taps: c.linear_conv_kernel_dim,
                eps: c.rms_norm_eps,
                qkv: &b.projected.read()[..conv_dim],
                z: &b.z.read()[..nv * dv],
                b: &b.beta.read()[..nv],
                a: &b.decay.read()[..nv],
            };
            let (conv_out, core) = (b.conv_out.sub(0, conv_dim), b.core.sub(0, nv * dv));
            team.tasks(nk, |kh| {
                decode_key_head(&inputs, kh, b.conv[slot], conv_out, b.recurrent[slot], core);
            });
            team.single(|| b.quantize_for(&b.core.read()[..nv * dv], &[&deltanet.out_proj]));
            let (x4, x8) = b.inputs();
            team_matvecs(
                team,
                &[TeamMatVec {
                    w: deltanet.out_proj.view(),
                    x: if deltanet.out_proj.bits == 4 { x4 } else { x8 },
                    out: b.mixer_out.sub(0, c.hidden_size),
                }],
            );
        }
    }

    /// Gated full attention of the token at `position`: its projections, its key normed and rotated and the key
    /// and value written to the cache (one thread), the query heads in tasks (norm, rotation, attention over the
    /// cache, sigmoid gate), the output projection.
    ///
    /// # Safety
    /// As for [`CpuModel::team_deltanet`].
    unsafe fn team_attention(&self, team: &Team, attn: &Attention, slot: usize, position: usize, b: &Buffers) {
        let c = self.config();
        let (hd, heads, kv_heads) = (c.head_dim, c.num_attention_heads, c.num_key_value_heads);
        let (q_dim, kv_dim, eps) = (c.q_dim(), c.kv_dim(), c.rms_norm_eps);
        unsafe {
            let (x4, x8) = b.inputs();
            let input = |m: &QMatrix| if m.bits == 4 { x4 } else { x8 };
            team_matvecs(
                team,
                &[
                    TeamMatVec {
                        w: attn.q_proj.view(),
                        x: input(&attn.q_proj),
                        out: b.projected.sub(0, 2 * q_dim),
                    },
                    TeamMatVec {
                        w: attn.k_proj.view(),
                        x: input(&attn.k_proj),
                        out: b.keys.sub(0, kv_dim),
                    },
                    TeamMatVec {
                        w: attn.v_proj.view(),
                        x: input(&attn.v_proj),
                        out: b.values.sub(0, kv_dim),
                    },
                ],
            );
            let (k_cache, v_cache) = (b.k_cache[slot], b.v_cache[slot]);
            team.single(|| {
                let keys = b.keys.part(0, kv_dim);
                for head in keys.chunks_exact_mut(hd) {
                    rmsnorm_row_in_place(head, &attn.k_norm, eps);
                    rope(head, position, &self.inv_freq);
                }
                k_cache.part(position * kv_dim, kv_dim).copy_from_slice(keys);
                v_cache
                    .part(position * kv_dim, kv_dim)
                    .copy_from_slice(&b.values.read()[..kv_dim]);
            });
            let visible = position + 1;
            let (k_cache, v_cache) = (&k_cache.read()[..visible * kv_dim], &v_cache.read()[..visible * kv_dim]);
            let projected = &b.projected.read()[..2 * q_dim];
            let scale = 1.0 / (hd as f32).sqrt();
            team.tasks(heads, |head| {
                let q = b.queries.part(head * hd, hd);
                rmsnorm_row(&projected[head * 2 * hd..head * 2 * hd + hd], &attn.q_norm, eps, q);
                rope(q, position, &self.inv_freq);
                let o = b.core.part(head * hd, hd);
                attend_head(
                    q,
                    k_cache,
                    v_cache,
                    visible,
                    head / (heads / kv_heads),
                    kv_dim,
                    scale,
                    o,
                );
                let gate = &projected[head * 2 * hd + hd..(head + 1) * 2 * hd];
                for (v, g) in o.iter_mut().zip(gate) {
                    *v *= sigmoid(*g);
                }
            });
            team.single(|| b.quantize_for(&b.core.read()[..q_dim], &[&attn.o_proj]));
            let (x4, x8) = b.inputs();
            team_matvecs(
                team,
                &[TeamMatVec {
                    w: attn.o_proj.view(),
                    x: if attn.o_proj.bits == 4 { x4 } else { x8 },
                    out: b.mixer_out.sub(0, c.hidden_size),
                }],
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    /// The team's decode step gives the logits, the routing margin and the state of the same step in fork-join
    /// regions, bit for bit, on pools of 1 and 3 threads, over steps that carry the state (DeltaNet and attention
    /// layers, a growing KV cache).
    #[test]
    fn team_decode_matches_decode_in_regions_bit_for_bit() {
        let mut config = Config::tiny_shape();
        config.quantization = Config::from_json(&config.to_mlx_json()).unwrap().quantization;
        let checkpoint = crate::synth::checkpoint_in_memory(&config, 7).unwrap();
        let weights = crate::Weights::from_checkpoint(config.clone(), &checkpoint).unwrap();
        let model = CpuModel::new(weights);
        let vocab = config.vocab_size;
        for threads in [1, 3] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| {
                let (mut team, mut regions) = (model.new_state(16), model.new_state(16));
                let (mut a, mut b) = (vec![0.0; vocab], vec![0.0; vocab]);
                model.prefill(&mut team, &[5, 17, 3], &mut a).unwrap();
                model.prefill(&mut regions, &[5, 17, 3], &mut b).unwrap();
                for (step, token) in [9u32, 1, 250, 44, 7, 7, 120].into_iter().enumerate() {
                    // The team's step (retried while another test's team runs), not the fallback of `decode`.
                    let start = std::time::Instant::now();
                    while !model.decode_step(&mut team, token, &mut a) {
                        assert!(start.elapsed().as_secs() < 60, "another team ran for a minute");
                        std::thread::sleep(std::time::Duration::from_millis(1));
                    }
                    model.decode_in_regions(&mut regions, token, &mut b).unwrap();
                    let same = a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits());
                    assert!(same, "{threads} threads, step {step}: logits differ");
                    assert_eq!(team.route_margin.to_bits(), regions.route_margin.to_bits());
                    assert_eq!(team.position, regions.position);
                }
                assert!(team.recurrent == regions.recurrent && team.conv == regions.conv);
                assert!(team.k_cache == regions.k_cache && team.v_cache == regions.v_cache);
            });
        }
    }
}
