//! The decode step on the CPU, run by a [`team`] of the pool's threads for one sequence or for several at once (a
//! batched step of the server's engine): for each row the same forward pass as a prompt of one token (the same
//! operations in the same order, so the same results, whatever rows are beside it), as a list of steps that every
//! thread executes. The products split into tasks of matrix rows, each task computing its rows for every row of the
//! step that reads that matrix, so a matrix is read from memory once a step however many sequences it serves
//! ([`team_matvec_runs`]); the experts' products likewise for the rows routed to each expert. The DeltaNet splits
//! into tasks of (row, key head), attention into tasks of (row, query head), and the short row-wise steps (norms,
//! quantizing an input, routing) into a task a row.

use smallvec::SmallVec;

use super::attention::{attend_head, rope};
use super::deltanet::{decode_key_head, DecodeInputs};
use super::linalg::{rmsnorm_row, rmsnorm_row_in_place, sigmoid, team_matvec_runs, TeamMatVec, TeamProducts, TeamRuns};
use super::model::{CpuModel, State};
use super::moe::{team_moe_decode, MoeParts, MoeRow};
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
    /// By the task of this row alone, no thread reading the row's inputs until the next barrier.
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

/// One sequence of a batched decode step: its state, the token it appends, and where its next-token logits go.
pub struct DecodeRow<'a> {
    pub state: &'a mut State,
    pub token: u32,
    pub logits: &'a mut [f32],
}

/// Where a product writes a row's output.
type RowOutput<'a, 'f> = &'f dyn Fn(&Buffers<'a>) -> Shared<'a, [f32]>;

/// Appends a run of `matrix` times the input of each row (quantized for its bits) into the output `out(row)`.
fn push_run<'a>(
    products: &mut TeamProducts<'a>,
    runs: &mut TeamRuns,
    matrix: &'a QMatrix,
    rows: &[Buffers<'a>],
    out: impl Fn(&Buffers<'a>) -> Shared<'a, [f32]>,
) {
    for b in rows {
        // SAFETY: read between the step that quantized the inputs and the next one that does.
        let (x4, x8) = unsafe { b.inputs() };
        products.push(TeamMatVec {
            w: matrix.view(),
            x: if matrix.bits == 4 { x4 } else { x8 },
            out: out(b),
        });
    }
    runs.push(products.len());
}

/// Runs the products of `matrices` (each a run over every row) as one step of the team.
fn run_products<'a>(team: &Team, rows: &[Buffers<'a>], matrices: &[(&'a QMatrix, RowOutput<'a, '_>)]) {
    let (mut products, mut runs) = (TeamProducts::new(), TeamRuns::new());
    runs.push(0);
    for &(matrix, out) in matrices {
        push_run(&mut products, &mut runs, matrix, rows, out);
    }
    team_matvec_runs(team, &products, &runs);
}

impl CpuModel {
    /// One decode step of one sequence ([`CpuModel::decode_rows_step`] with one row).
    pub(super) fn decode_step(&self, state: &mut State, token: u32, logits: &mut [f32]) -> bool {
        self.decode_rows_step(&mut [DecodeRow { state, token, logits }])
    }

    /// One decode step of every row at once (see the module comment): appends each row's token to its sequence and
    /// writes its next-token logits, exactly as a step of that sequence alone would. The rows' states must be
    /// distinct and have room for a token (the caller checks). Returns false, changing nothing, when another team
    /// is running (see [`team::try_run`]).
    pub(super) fn decode_rows_step(&self, rows: &mut [DecodeRow]) -> bool {
        let c = self.config();
        let w = &self.weights;
        let (h, eps) = (c.hidden_size, c.rms_norm_eps);
        let tokens: SmallVec<[u32; 8]> = rows.iter().map(|r| r.token).collect();
        let positions: SmallVec<[usize; 8]> = rows.iter().map(|r| r.state.position).collect();
        let n = rows.len();
        let ran = {
            let b: SmallVec<[Buffers; 1]> = rows
                .iter_mut()
                .map(|r| Buffers::new(&mut *r.state, &mut *r.logits))
                .collect();
            let b = &b[..];
            // SAFETY (every access to `b` below): the team's steps follow the rules of `Shared`: a task writes
            // only its own row's buffers (or disjoint parts of them), and barriers separate writes from later
            // reads.
            team::try_run(|team| unsafe {
                for (l, layer) in w.layers.iter().enumerate() {
                    let matrices = match &layer.mixer {
                        Mixer::Linear(d) => [&d.in_proj_qkv, &d.in_proj_z, &d.in_proj_b, &d.in_proj_a],
                        Mixer::Full(a) => [&a.q_proj, &a.k_proj, &a.v_proj, &a.v_proj],
                    };
                    team.tasks(n, |r| {
                        let b = &b[r];
                        let hidden = b.hidden.part(0, h);
                        if l == 0 {
                            w.embed_tokens.view().dequantize_row(tokens[r] as usize, hidden);
                            *b.route_margin.get() = f32::INFINITY;
                        } else {
                            add(hidden, b.moe_out.part(0, h));
                        }
                        let normed = b.normed.part(0, h);
                        rmsnorm_row(hidden, &layer.input_layernorm, eps, normed);
                        b.quantize_for(normed, &matrices);
                    });
                    match &layer.mixer {
                        Mixer::Linear(deltanet) => self.team_deltanet(team, deltanet, self.slot[l], b),
                        Mixer::Full(attn) => self.team_attention(team, attn, self.slot[l], &positions, b),
                    }
                    let m = &layer.moe;
                    let matrices = [
                        &m.router,
                        &m.shared_expert_gate,
                        &m.shared_gate,
                        &m.shared_up,
                        &m.experts_gate,
                        &m.experts_up,
                    ];
                    team.tasks(n, |r| {
                        let b = &b[r];
                        let hidden = b.hidden.part(0, h);
                        add(hidden, b.mixer_out.part(0, h));
                        let normed = b.normed.part(0, h);
                        rmsnorm_row(hidden, &layer.post_attention_layernorm, eps, normed);
                        b.quantize_for(normed, &matrices);
                    });
                    let moe_rows: SmallVec<[MoeRow; 1]> = b
                        .iter()
                        .map(|b| {
                            let (x4, x8) = b.inputs();
                            MoeRow {
                                x4,
                                x8,
                                parts: &b.moe,
                                out: b.moe_out.sub(0, h),
                                margin: b.route_margin,
                            }
                        })
                        .collect();
                    team_moe_decode(team, m, c.num_experts, c.num_experts_per_tok, &moe_rows);
                }
                team.tasks(n, |r| {
                    let b = &b[r];
                    let hidden = b.hidden.part(0, h);
                    add(hidden, b.moe_out.part(0, h));
                    let normed = b.normed.part(0, h);
                    rmsnorm_row(hidden, &w.final_norm, eps, normed);
                    b.quantize_for(normed, &[&w.lm_head]);
                });
                run_products(team, b, &[(&w.lm_head, &|b| b.logits)]);
            })
        };
        if ran {
            for r in rows.iter_mut() {
                r.state.position += 1;
            }
        }
        ran
    }

    /// The Gated DeltaNet of each row's token: the projections, the heads in tasks of (row, key head)
    /// ([`decode_key_head`]), the output projection.
    ///
    /// # Safety
    /// Called by every thread of the team, each row's `x4` and `x8` holding its normed input quantized for the
    /// projections.
    unsafe fn team_deltanet(&self, team: &Team, deltanet: &GatedDeltaNet, slot: usize, b: &[Buffers]) {
        let c = self.config();
        let (nk, nv, dv) = (
            c.linear_num_key_heads,
            c.linear_num_value_heads,
            c.linear_value_head_dim,
        );
        let conv_dim = c.linear_conv_dim();
        unsafe {
            run_products(
                team,
                b,
                &[
                    (&deltanet.in_proj_qkv, &|b| b.projected.sub(0, conv_dim)),
                    (&deltanet.in_proj_z, &|b| b.z.sub(0, nv * dv)),
                    (&deltanet.in_proj_b, &|b| b.beta.sub(0, nv)),
                    (&deltanet.in_proj_a, &|b| b.decay.sub(0, nv)),
                ],
            );
            team.tasks(b.len() * nk, |task| {
                let (b, kh) = (&b[task / nk], task % nk);
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
                decode_key_head(&inputs, kh, b.conv[slot], conv_out, b.recurrent[slot], core);
            });
            team.tasks(b.len(), |r| {
                b[r].quantize_for(&b[r].core.read()[..nv * dv], &[&deltanet.out_proj])
            });
            run_products(team, b, &[(&deltanet.out_proj, &|b| b.mixer_out.sub(0, c.hidden_size))]);
        }
    }

    /// Gated full attention of each row's token at its position: the projections; each row's key normed and
    /// rotated and its key and value written to its cache (a task a row); the query heads in tasks of (row, head)
    /// (norm, rotation, attention over the row's cache, sigmoid gate); the output projection.
    ///
    /// # Safety
    /// As for [`CpuModel::team_deltanet`].
    unsafe fn team_attention(&self, team: &Team, attn: &Attention, slot: usize, positions: &[usize], b: &[Buffers]) {
        let c = self.config();
        let (hd, heads, kv_heads) = (c.head_dim, c.num_attention_heads, c.num_key_value_heads);
        let (q_dim, kv_dim, eps) = (c.q_dim(), c.kv_dim(), c.rms_norm_eps);
        unsafe {
            run_products(
                team,
                b,
                &[
                    (&attn.q_proj, &|b| b.projected.sub(0, 2 * q_dim)),
                    (&attn.k_proj, &|b| b.keys.sub(0, kv_dim)),
                    (&attn.v_proj, &|b| b.values.sub(0, kv_dim)),
                ],
            );
            team.tasks(b.len(), |r| {
                let (b, position) = (&b[r], positions[r]);
                let keys = b.keys.part(0, kv_dim);
                for head in keys.chunks_exact_mut(hd) {
                    rmsnorm_row_in_place(head, &attn.k_norm, eps);
                    rope(head, position, &self.inv_freq);
                }
                b.k_cache[slot].part(position * kv_dim, kv_dim).copy_from_slice(keys);
                b.v_cache[slot]
                    .part(position * kv_dim, kv_dim)
                    .copy_from_slice(&b.values.read()[..kv_dim]);
            });
            let scale = 1.0 / (hd as f32).sqrt();
            team.tasks(b.len() * heads, |task| {
                let (r, head) = (task / heads, task % heads);
                let (b, position) = (&b[r], positions[r]);
                let visible = position + 1;
                let k_cache = &b.k_cache[slot].read()[..visible * kv_dim];
                let v_cache = &b.v_cache[slot].read()[..visible * kv_dim];
                let projected = &b.projected.read()[..2 * q_dim];
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
            team.tasks(b.len(), |r| {
                b[r].quantize_for(&b[r].core.read()[..q_dim], &[&attn.o_proj])
            });
            run_products(team, b, &[(&attn.o_proj, &|b| b.mixer_out.sub(0, c.hidden_size))]);
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
    /// A batched step gives each row the logits, routing margin and state of that row's step alone, bit for bit, on
    /// pools of 1 and 3 threads: rows at different positions (attention over caches of different lengths), steps
    /// whose rows change, and a step of one row.
    #[test]
    fn batched_rows_match_each_sequence_alone_bit_for_bit() {
        let mut config = Config::tiny_shape();
        config.quantization = Config::from_json(&config.to_mlx_json()).unwrap().quantization;
        let checkpoint = crate::synth::checkpoint_in_memory(&config, 11).unwrap();
        let weights = crate::Weights::from_checkpoint(config.clone(), &checkpoint).unwrap();
        let model = CpuModel::new(weights);
        let vocab = config.vocab_size;
        let prompts: [&[u32]; 4] = [&[5, 17, 3], &[9], &[200, 1, 2, 3, 4, 5, 6], &[42, 42]];
        // Which sequences take part in each step.
        let steps: [&[usize]; 5] = [&[0, 1, 2, 3], &[2, 0], &[3], &[1, 3, 0, 2], &[0, 1, 2, 3]];
        for threads in [1, 3] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| {
                let mut batched: Vec<State> = prompts.iter().map(|_| model.new_state(32)).collect();
                let mut alone: Vec<State> = prompts.iter().map(|_| model.new_state(32)).collect();
                let mut scratch = vec![0.0; vocab];
                for (i, prompt) in prompts.iter().enumerate() {
                    model.prefill(&mut batched[i], prompt, &mut scratch).unwrap();
                    model.prefill(&mut alone[i], prompt, &mut scratch).unwrap();
                }
                for (step, members) in steps.iter().enumerate() {
                    let tokens: Vec<u32> = members
                        .iter()
                        .map(|&i| (step * 31 + i * 7) as u32 % vocab as u32)
                        .collect();
                    let mut outs = vec![vec![0.0f32; vocab]; members.len()];
                    {
                        let mut states: Vec<Option<&mut State>> = batched.iter_mut().map(Some).collect();
                        let mut rows: Vec<DecodeRow> = members
                            .iter()
                            .zip(&tokens)
                            .zip(outs.iter_mut())
                            .map(|((&i, &token), logits)| DecodeRow {
                                state: states[i].take().unwrap(),
                                token,
                                logits,
                            })
                            .collect();
                        // The team's step (retried while another test's team runs), not the fallback.
                        let start = std::time::Instant::now();
                        while !model.decode_rows_step(&mut rows) {
                            assert!(start.elapsed().as_secs() < 60, "another team ran for a minute");
                            std::thread::sleep(std::time::Duration::from_millis(1));
                        }
                    }
                    for ((&i, &token), out) in members.iter().zip(&tokens).zip(&outs) {
                        let mut expected = vec![0.0; vocab];
                        model.decode_in_regions(&mut alone[i], token, &mut expected).unwrap();
                        let same = out.iter().zip(&expected).all(|(x, y)| x.to_bits() == y.to_bits());
                        assert!(same, "{threads} threads, step {step}, sequence {i}: logits differ");
                        assert_eq!(batched[i].route_margin.to_bits(), alone[i].route_margin.to_bits());
                        assert_eq!(batched[i].position, alone[i].position);
                    }
                }
                for (a, b) in batched.iter().zip(&alone) {
                    assert!(a.recurrent == b.recurrent && a.conv == b.conv);
                    assert!(a.k_cache == b.k_cache && a.v_cache == b.v_cache);
                }
            });
        }
    }
}
