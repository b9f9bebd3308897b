//! The sparse MoE block on the CPU: softmax router, top-k renormalised, SwiGLU experts read in place from the
//! stacked tensors, plus the sigmoid-gated shared expert.

use std::cell::RefCell;

use rayon::prelude::*;

use smallvec::SmallVec;

use super::linalg::{
    gemms, matvecs, sigmoid, silu, team_matvec_runs, Gemm, MatVec, TeamMatVec, TeamProducts, TeamRuns,
};
use super::simd::QInput;
use super::team::{Shared, Team};
use crate::config::Config;
use crate::sampling::rank_value;
use crate::weights::Moe;

/// Softmax over the router logits, the `k` largest (lowest index first on ties), renormalised to sum to one. A NaN
/// logit counts as negative infinity ([`rank_value`]): it weighs nothing, and the `k` experts are distinct however
/// many logits are NaN.
pub fn route(logits: &[f32], k: usize, experts: &mut [usize], weights: &mut [f32]) {
    let value = |e: usize| rank_value(logits[e]);
    let max = (0..logits.len()).map(value).fold(f32::NEG_INFINITY, f32::max);
    let denom: f32 = (0..logits.len()).map(|e| (value(e) - max).exp()).sum();
    let mut chosen_sum = 0.0;
    for slot in 0..k {
        let mut best = usize::MAX;
        for e in 0..logits.len() {
            if !experts[..slot].contains(&e) && (best == usize::MAX || value(e) > value(best)) {
                best = e;
            }
        }
        experts[slot] = best;
        weights[slot] = (value(best) - max).exp() / denom;
        chosen_sum += weights[slot];
    }
    weights[..k].iter_mut().for_each(|w| *w /= chosen_sum);
}

/// How close the routing (`chosen`, from [`route`]) came to choosing otherwise: the gap between the smallest
/// chosen logit and the largest one not chosen, relative to the largest magnitude (infinite when every expert is
/// chosen).
pub fn route_margin(logits: &[f32], chosen: &[usize]) -> f32 {
    let last_chosen = chosen.iter().map(|&e| logits[e]).fold(f32::INFINITY, f32::min);
    let first_left = logits
        .iter()
        .enumerate()
        .filter(|(e, _)| !chosen.contains(e))
        .map(|(_, l)| *l)
        .fold(f32::NEG_INFINITY, f32::max);
    let scale = logits.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    (last_chosen - first_left) / scale
}

/// Buffers of the prompt MoE ([`moe_forward`]), kept per thread from call to call.
#[derive(Default)]
struct PromptScratch {
    /// Per token: the router's logits `[tokens][experts]`, the chosen experts and their weights `[tokens][k]`, the
    /// shared expert's gate logit.
    logits: Vec<f32>,
    chosen: Vec<usize>,
    weights: Vec<f32>,
    shared_gate: Vec<f32>,
    /// The routing slot (`t * k + slot`) of each assignment of a token to an expert, sorted by expert (then
    /// token), and the place in that order of each routing slot.
    assigned: Vec<usize>,
    place: Vec<usize>,
    /// Per expert: its first assignment in that order (`experts + 1` entries).
    first: Vec<usize>,
    /// Per assignment, in that order: the gate projection (then the SwiGLU activation) and the up projection,
    /// `[tokens * k][inter]`, and the down projection, `[tokens * k][hidden]`.
    gate: Vec<f32>,
    up: Vec<f32>,
    down: Vec<f32>,
    /// The same for the shared expert, per token.
    shared_g: Vec<f32>,
    shared_u: Vec<f32>,
    shared_down: Vec<f32>,
}

thread_local! {
    static PROMPT_SCRATCH: RefCell<PromptScratch> = RefCell::new(PromptScratch::default());
}

/// Splits `buf` into consecutive pieces of `len * count` values, one per count.
fn split_by(mut buf: &mut [f32], len: usize, counts: impl Iterator<Item = usize>) -> Vec<&mut [f32]> {
    counts
        .map(|count| {
            let (piece, rest) = std::mem::take(&mut buf).split_at_mut(count * len);
            buf = rest;
            piece
        })
        .collect()
}

/// `out = moe(x)` for `[tokens][hidden]` inputs, in three parallel regions of f32 products ([`gemms`]): the
/// router, the shared expert's gate and up projections and its sigmoid gate, for every token; each chosen expert's
/// gate and up projections over the tokens routed to it; each expert's down projection. So each expert's rows are
/// read once for all of its tokens. Returns the smallest routing margin of the tokens.
pub fn moe_forward(moe: &Moe, num_experts: usize, top_k: usize, x: &[f32], out: &mut [f32]) -> f32 {
    let hidden = moe.router.cols;
    let tokens = x.len() / hidden;
    let inter = moe.experts_gate.rows / num_experts;
    let shared_inter = moe.shared_gate.rows;
    assert!(x.len() == tokens * hidden && out.len() == x.len());
    // Taken out of the thread-local for the call (a nested call would start from empty buffers).
    let mut s = PROMPT_SCRATCH.with(|s| std::mem::take(&mut *s.borrow_mut()));
    let xs: Vec<&[f32]> = x.chunks_exact(hidden).collect();

    s.logits.resize(tokens * num_experts, 0.0);
    s.shared_gate.resize(tokens, 0.0);
    s.shared_g.resize(tokens * shared_inter, 0.0);
    s.shared_u.resize(tokens * shared_inter, 0.0);
    gemms(&mut [
        Gemm {
            w: moe.router.view(),
            xs: &xs,
            out: &mut s.logits,
        },
        Gemm {
            w: moe.shared_expert_gate.view(),
            xs: &xs,
            out: &mut s.shared_gate,
        },
        Gemm {
            w: moe.shared_gate.view(),
            xs: &xs,
            out: &mut s.shared_g,
        },
        Gemm {
            w: moe.shared_up.view(),
            xs: &xs,
            out: &mut s.shared_u,
        },
    ]);

    let slots = tokens * top_k;
    s.chosen.resize(slots, 0);
    s.weights.resize(slots, 0.0);
    let margin = s
        .logits
        .par_chunks(num_experts)
        .zip(s.chosen.par_chunks_mut(top_k))
        .zip(s.weights.par_chunks_mut(top_k))
        .map(|((logits, chosen), weights)| {
            route(logits, top_k, chosen, weights);
            route_margin(logits, chosen)
        })
        .reduce(|| f32::INFINITY, f32::min);
    // Assignments sorted by expert: count each expert's, then place each routing slot after its expert's earlier
    // ones.
    s.first.clear();
    s.first.resize(num_experts + 1, 0);
    for &e in &s.chosen {
        s.first[e + 1] += 1;
    }
    for e in 0..num_experts {
        s.first[e + 1] += s.first[e];
    }
    s.assigned.resize(slots, 0);
    s.place.resize(slots, 0);
    let mut next = s.first[..num_experts].to_vec();
    for (slot, &e) in s.chosen.iter().enumerate() {
        s.assigned[next[e]] = slot;
        s.place[slot] = next[e];
        next[e] += 1;
    }
    let counts = || s.first.windows(2).map(|w| w[1] - w[0]);

    let routed: Vec<&[f32]> = s.assigned.iter().map(|&slot| xs[slot / top_k]).collect();
    s.gate.resize(slots * inter, 0.0);
    s.up.resize(slots * inter, 0.0);
    {
        let gates = split_by(&mut s.gate, inter, counts());
        let ups = split_by(&mut s.up, inter, counts());
        let mut batch = Vec::with_capacity(2 * num_experts);
        for (e, (g, u)) in gates.into_iter().zip(ups).enumerate() {
            let xs = &routed[s.first[e]..s.first[e + 1]];
            if !xs.is_empty() {
                batch.push(Gemm {
                    w: moe.experts_gate.rows_view(e * inter, inter),
                    xs,
                    out: g,
                });
                batch.push(Gemm {
                    w: moe.experts_up.rows_view(e * inter, inter),
                    xs,
                    out: u,
                });
            }
        }
        gemms(&mut batch);
    }

    let swiglu = |(g, u): (&mut [f32], &[f32])| {
        for (gi, ui) in g.iter_mut().zip(u) {
            *gi = silu(*gi) * ui;
        }
    };
    s.gate
        .par_chunks_mut(inter)
        .zip(s.up.par_chunks(inter))
        .for_each(swiglu);
    s.shared_g
        .par_chunks_mut(shared_inter)
        .zip(s.shared_u.par_chunks(shared_inter))
        .for_each(swiglu);

    s.down.resize(slots * hidden, 0.0);
    s.shared_down.resize(tokens * hidden, 0.0);
    {
        let acts: Vec<&[f32]> = s.gate.chunks_exact(inter).collect();
        let shared_acts: Vec<&[f32]> = s.shared_g.chunks_exact(shared_inter).collect();
        let mut batch = Vec::with_capacity(num_experts + 1);
        batch.push(Gemm {
            w: moe.shared_down.view(),
            xs: &shared_acts,
            out: &mut s.shared_down,
        });
        for (e, y) in split_by(&mut s.down, hidden, counts()).into_iter().enumerate() {
            let xs = &acts[s.first[e]..s.first[e + 1]];
            if !xs.is_empty() {
                batch.push(Gemm {
                    w: moe.experts_down.rows_view(e * hidden, hidden),
                    xs,
                    out: y,
                });
            }
        }
        gemms(&mut batch);
    }

    // Per token: the gated shared expert, then the routed experts in routing order (as `moe_decode` sums them).
    let s_ref = &s;
    out.par_chunks_mut(hidden).enumerate().for_each(|(t, out)| {
        let shared = sigmoid(s_ref.shared_gate[t]);
        let y = &s_ref.shared_down[t * hidden..(t + 1) * hidden];
        out.iter_mut().zip(y).for_each(|(o, v)| *o = v * shared);
        for slot in t * top_k..(t + 1) * top_k {
            let (w, place) = (s_ref.weights[slot], s_ref.place[slot]);
            let y = &s_ref.down[place * hidden..(place + 1) * hidden];
            out.iter_mut().zip(y).for_each(|(o, v)| *o += w * v);
        }
    });
    PROMPT_SCRATCH.with(|scratch| *scratch.borrow_mut() = s);
    margin
}

/// Buffers of the one-token MoE ([`moe_decode`]), allocated once with the sequence state.
#[derive(Clone)]
pub struct MoeScratch {
    logits: Vec<f32>,
    chosen: Vec<usize>,
    weights: Vec<f32>,
    /// The input quantized for 4-bit and for 8-bit matrices.
    x4: QInput,
    x8: QInput,
    /// Per expert (the routed ones in routing order, then the shared one): gate and up projections, `[k + 1][inter]`.
    gate: Vec<f32>,
    up: Vec<f32>,
    /// Per expert: the SwiGLU activations quantized for the down projection.
    acts: Vec<QInput>,
    /// Per expert: the down projection, `[k + 1][hidden]`.
    down: Vec<f32>,
    shared_gate: [f32; 1],
}

impl MoeScratch {
    pub fn new(c: &Config) -> MoeScratch {
        let slots = c.num_experts_per_tok + 1;
        let inter = c.moe_intermediate_size.max(c.shared_expert_intermediate_size);
        MoeScratch {
            logits: vec![0.0; c.num_experts],
            chosen: vec![0; c.num_experts_per_tok],
            weights: vec![0.0; c.num_experts_per_tok],
            x4: QInput::new(),
            x8: QInput::new(),
            gate: vec![0.0; slots * inter],
            up: vec![0.0; slots * inter],
            acts: (0..slots).map(|_| QInput::new()).collect(),
            down: vec![0.0; slots * c.hidden_size],
            shared_gate: [0.0],
        }
    }
}

/// The quantized input of a matrix of `bits` bits.
fn input_for<'a>(bits: u32, x4: &'a QInput, x8: &'a QInput) -> &'a QInput {
    if bits == 4 {
        x4
    } else {
        x8
    }
}

/// `out = moe(x)` for one token, as [`moe_forward`] computes it, in three parallel regions: the router, the
/// shared expert's gate and up projections and its sigmoid gate; the routed experts' gate and up projections; every
/// expert's down projection. Allocates nothing. Returns the routing margin.
pub fn moe_decode(moe: &Moe, num_experts: usize, top_k: usize, x: &[f32], out: &mut [f32], s: &mut MoeScratch) -> f32 {
    let hidden = moe.router.cols;
    let inter = moe.experts_gate.rows / num_experts;
    let shared_inter = moe.shared_gate.rows;
    assert!(x.len() == hidden && out.len() == hidden && s.chosen.len() == top_k);
    s.x4.quantize(x, 4);
    s.x8.quantize(x, 8);
    let (x4, x8) = (&s.x4, &s.x8);
    let slots = top_k + 1;
    let (gate, up) = (
        &mut s.gate[..slots * inter.max(shared_inter)],
        &mut s.up[..slots * inter.max(shared_inter)],
    );
    let (routed_gate, shared_gate) = gate.split_at_mut(top_k * inter);
    let (routed_up, shared_up) = up.split_at_mut(top_k * inter);
    let (shared_gate, shared_up) = (&mut shared_gate[..shared_inter], &mut shared_up[..shared_inter]);
    matvecs(&mut [
        MatVec {
            w: moe.router.view(),
            x: input_for(moe.router.bits, x4, x8),
            out: &mut s.logits,
        },
        MatVec {
            w: moe.shared_expert_gate.view(),
            x: input_for(moe.shared_expert_gate.bits, x4, x8),
            out: &mut s.shared_gate,
        },
        MatVec {
            w: moe.shared_gate.view(),
            x: input_for(moe.shared_gate.bits, x4, x8),
            out: shared_gate,
        },
        MatVec {
            w: moe.shared_up.view(),
            x: input_for(moe.shared_up.bits, x4, x8),
            out: shared_up,
        },
    ]);
    route(&s.logits, top_k, &mut s.chosen, &mut s.weights);
    let margin = route_margin(&s.logits, &s.chosen);

    let mut batch: [MatVec; 2 * MAX_TOP_K] = std::array::from_fn(|_| MatVec::empty());
    assert!(top_k <= MAX_TOP_K, "{top_k} experts per token");
    for ((slot, (g, u)), &e) in batch
        .chunks_exact_mut(2)
        .zip(
            routed_gate
                .chunks_exact_mut(inter)
                .zip(routed_up.chunks_exact_mut(inter)),
        )
        .zip(&s.chosen)
    {
        let (gate_w, up_w) = (
            moe.experts_gate.rows_view(e * inter, inter),
            moe.experts_up.rows_view(e * inter, inter),
        );
        slot[0] = MatVec {
            x: input_for(gate_w.bits, x4, x8),
            w: gate_w,
            out: g,
        };
        slot[1] = MatVec {
            x: input_for(up_w.bits, x4, x8),
            w: up_w,
            out: u,
        };
    }
    matvecs(&mut batch[..2 * top_k]);

    for (i, act) in s.acts[..slots].iter_mut().enumerate() {
        let (n, bits) = if i < top_k {
            (inter, moe.experts_down.bits)
        } else {
            (shared_inter, moe.shared_down.bits)
        };
        let (g, u) = (&mut s.gate[i * inter..i * inter + n], &s.up[i * inter..i * inter + n]);
        for (gi, ui) in g.iter_mut().zip(u) {
            *gi = silu(*gi) * ui;
        }
        act.quantize(g, bits);
    }
    let mut batch: [MatVec; MAX_TOP_K + 1] = std::array::from_fn(|_| MatVec::empty());
    for (i, (slot, y)) in batch
        .iter_mut()
        .zip(s.down.chunks_exact_mut(hidden))
        .take(slots)
        .enumerate()
    {
        let w = if i < top_k {
            moe.experts_down.rows_view(s.chosen[i] * hidden, hidden)
        } else {
            moe.shared_down.view()
        };
        *slot = MatVec {
            w,
            x: &s.acts[i],
            out: y,
        };
    }
    matvecs(&mut batch[..slots]);

    let shared = sigmoid(s.shared_gate[0]);
    let y = &s.down[top_k * hidden..slots * hidden];
    out.iter_mut().zip(y).for_each(|(o, v)| *o = v * shared);
    for (i, &w) in s.weights.iter().enumerate() {
        let y = &s.down[i * hidden..(i + 1) * hidden];
        out.iter_mut().zip(y).for_each(|(o, v)| *o += w * v);
    }
    margin
}

/// The buffers of a [`MoeScratch`] as the threads of a team share them ([`team_moe_decode`]).
pub struct MoeParts<'a> {
    logits: Shared<'a, [f32]>,
    chosen: Shared<'a, [usize]>,
    weights: Shared<'a, [f32]>,
    gate: Shared<'a, [f32]>,
    up: Shared<'a, [f32]>,
    acts: Shared<'a, [QInput]>,
    down: Shared<'a, [f32]>,
    shared_gate: Shared<'a, [f32]>,
}

impl MoeScratch {
    pub fn parts(&mut self) -> MoeParts<'_> {
        MoeParts {
            logits: Shared::new(&mut self.logits[..]),
            chosen: Shared::new(&mut self.chosen[..]),
            weights: Shared::new(&mut self.weights[..]),
            gate: Shared::new(&mut self.gate[..]),
            up: Shared::new(&mut self.up[..]),
            acts: Shared::new(&mut self.acts[..]),
            down: Shared::new(&mut self.down[..]),
            shared_gate: Shared::new(&mut self.shared_gate[..]),
        }
    }
}

/// One row of a batched step for [`team_moe_decode`]: its input quantized for the bits of the matrices that read it,
/// its buffers, its output, and its routing margin (lowered to this layer's where that is smaller).
pub struct MoeRow<'a> {
    pub x4: &'a QInput,
    pub x8: &'a QInput,
    pub parts: &'a MoeParts<'a>,
    pub out: Shared<'a, [f32]>,
    pub margin: Shared<'a, f32>,
}

/// `out = moe(x)` for each row's token as steps of a team, computing what [`moe_decode`] computes for it: the
/// router and the shared expert's projections; the routing (a task a row); the routed experts' gate and up
/// projections; each (row, expert) SwiGLU and its quantization; every expert's down projection; each row's weighted
/// sum. An expert's products take every row routed to it at once, so its rows are read from memory once a step.
pub fn team_moe_decode<'a>(team: &Team, moe: &'a Moe, num_experts: usize, top_k: usize, rows: &[MoeRow<'a>]) {
    let input = |row: &MoeRow<'a>, bits: u32| -> &'a QInput { input_for(bits, row.x4, row.x8) };
    let hidden = moe.router.cols;
    let inter = moe.experts_gate.rows / num_experts;
    let shared_inter = moe.shared_gate.rows;
    let slots = top_k + 1;
    assert!(top_k <= MAX_TOP_K);
    for row in rows {
        let s = row.parts;
        assert!(s.chosen.len() == top_k && row.out.len() == hidden);
        assert!(s.logits.len() == num_experts && s.gate.len() >= slots * inter.max(shared_inter));
    }
    // SAFETY (every access below): each step writes disjoint parts of the buffers (one task per row range of a
    // matrix, per row, or per (row, expert)) and reads only what earlier steps wrote, after their barrier.
    unsafe {
        let shared_offset = top_k * inter;
        let (mut products, mut runs) = (TeamProducts::new(), TeamRuns::new());
        runs.push(0);
        for (k, matrix) in [&moe.router, &moe.shared_expert_gate, &moe.shared_gate, &moe.shared_up]
            .into_iter()
            .enumerate()
        {
            for row in rows {
                let s = row.parts;
                let out = match k {
                    0 => s.logits,
                    1 => s.shared_gate,
                    2 => s.gate.sub(shared_offset, shared_inter),
                    _ => s.up.sub(shared_offset, shared_inter),
                };
                products.push(TeamMatVec {
                    w: matrix.view(),
                    x: input(row, matrix.bits),
                    out,
                });
            }
            runs.push(products.len());
        }
        team_matvec_runs(team, &products, &runs);

        team.tasks(rows.len(), |r| {
            let (s, margin) = (rows[r].parts, rows[r].margin.get());
            let logits = s.logits.read();
            route(logits, top_k, s.chosen.part(0, top_k), s.weights.part(0, top_k));
            *margin = margin.min(route_margin(logits, s.chosen.read()));
        });

        // The (expert, row, slot) of every routed choice, by expert: each expert's choices form a run.
        let mut choices: SmallVec<[(usize, usize, usize); MAX_TOP_K]> = rows
            .iter()
            .enumerate()
            .flat_map(|(r, row)| row.parts.chosen.read().iter().enumerate().map(move |(i, &e)| (e, r, i)))
            .collect();
        choices.sort_unstable();
        let by_expert = |choices: &[(usize, usize, usize)]| {
            let mut runs = TeamRuns::new();
            runs.push(0);
            for (i, pair) in choices.windows(2).enumerate() {
                if pair[0].0 != pair[1].0 {
                    runs.push(i + 1);
                }
            }
            if !choices.is_empty() {
                runs.push(choices.len());
            }
            runs
        };
        let expert_runs = by_expert(&choices);

        let (mut products, mut runs) = (TeamProducts::new(), TeamRuns::new());
        runs.push(0);
        for run in expert_runs.windows(2) {
            let expert = choices[run[0]].0;
            let gate_w = moe.experts_gate.rows_view(expert * inter, inter);
            let up_w = moe.experts_up.rows_view(expert * inter, inter);
            for (w, out) in [(gate_w, true), (up_w, false)] {
                for &(_, r, i) in &choices[run[0]..run[1]] {
                    let s = rows[r].parts;
                    products.push(TeamMatVec {
                        x: input(&rows[r], w.bits),
                        w,
                        out: if out {
                            s.gate.sub(i * inter, inter)
                        } else {
                            s.up.sub(i * inter, inter)
                        },
                    });
                }
                runs.push(products.len());
            }
        }
        team_matvec_runs(team, &products, &runs);

        team.tasks(rows.len() * slots, |task| {
            let (s, i) = (rows[task / slots].parts, task % slots);
            let (n, bits) = if i < top_k {
                (inter, moe.experts_down.bits)
            } else {
                (shared_inter, moe.shared_down.bits)
            };
            let (g, u) = (s.gate.part(i * inter, n), &s.up.read()[i * inter..i * inter + n]);
            for (gi, ui) in g.iter_mut().zip(u) {
                *gi = silu(*gi) * ui;
            }
            s.acts.part(i, 1)[0].quantize(g, bits);
        });

        let (mut products, mut runs) = (TeamProducts::new(), TeamRuns::new());
        runs.push(0);
        for run in expert_runs.windows(2) {
            let w = moe.experts_down.rows_view(choices[run[0]].0 * hidden, hidden);
            for &(_, r, i) in &choices[run[0]..run[1]] {
                let s = rows[r].parts;
                products.push(TeamMatVec {
                    w,
                    x: &s.acts.read()[i],
                    out: s.down.sub(i * hidden, hidden),
                });
            }
            runs.push(products.len());
        }
        for row in rows {
            let s = row.parts;
            products.push(TeamMatVec {
                w: moe.shared_down.view(),
                x: &s.acts.read()[top_k],
                out: s.down.sub(top_k * hidden, hidden),
            });
        }
        runs.push(products.len());
        team_matvec_runs(team, &products, &runs);

        team.tasks(rows.len(), |r| {
            let s = rows[r].parts;
            let (out, down, weights) = (rows[r].out.part(0, hidden), s.down.read(), s.weights.read());
            let shared = sigmoid(s.shared_gate.read()[0]);
            let y = &down[top_k * hidden..slots * hidden];
            out.iter_mut().zip(y).for_each(|(o, v)| *o = v * shared);
            for (i, &w) in weights.iter().enumerate() {
                let y = &down[i * hidden..(i + 1) * hidden];
                out.iter_mut().zip(y).for_each(|(o, v)| *o += w * v);
            }
        });
    }
}

/// Most experts per token [`moe_decode`] takes (the model chooses 8; the config refuses more).
const MAX_TOP_K: usize = crate::config::MAX_TOP_K;

#[cfg(test)]
mod tests {
    use super::*;

    /// The one-token MoE (three parallel regions, integer products) against the prompt MoE (experts over their
    /// tokens, f32 products where an expert has several) on a synthetic tiny model's layers.
    #[test]
    fn moe_decode_matches_moe_forward_token_by_token() {
        let mut config = Config::tiny_shape();
        config.quantization = Config::from_json(&config.to_mlx_json()).unwrap().quantization;
        let checkpoint = crate::synth::checkpoint_in_memory(&config, 3).unwrap();
        let weights = crate::Weights::from_checkpoint(config.clone(), &checkpoint).unwrap();
        let (hidden, tokens) = (config.hidden_size, 6);
        let mut rng = crate::rng::Rng::new(5);
        let x: Vec<f32> = (0..tokens * hidden).map(|_| rng.normal()).collect();
        let mut scratch = MoeScratch::new(&config);
        for layer in &weights.layers {
            let (e, k) = (config.num_experts, config.num_experts_per_tok);
            let mut whole = vec![0.0; tokens * hidden];
            let margin = moe_forward(&layer.moe, e, k, &x, &mut whole);
            let mut one = vec![f32::NAN; hidden];
            let mut smallest = f32::INFINITY;
            for t in 0..tokens {
                let m = moe_decode(
                    &layer.moe,
                    e,
                    k,
                    &x[t * hidden..(t + 1) * hidden],
                    &mut one,
                    &mut scratch,
                );
                smallest = smallest.min(m);
                let reference = &whole[t * hidden..(t + 1) * hidden];
                let scale = reference.iter().fold(1.0f32, |a, v| a.max(v.abs()));
                for (a, b) in one.iter().zip(reference) {
                    assert!((a - b).abs() <= 1e-5 * scale, "token {t}: {a} vs {b}");
                }
            }
            // The router's logits differ by f32 rounding between the two paths, and so may the margin.
            assert!((smallest - margin).abs() <= 1e-5, "margin {smallest} vs {margin}");
        }
    }

    #[test]
    fn route_takes_the_top_k_and_renormalises() {
        let logits = [0.1, 2.0, -1.0, 2.0, 0.5, 3.0];
        let mut experts = [0; 3];
        let mut weights = [0.0; 3];
        route(&logits, 3, &mut experts, &mut weights);
        assert_eq!(experts, [5, 1, 3]);
        assert!((weights.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        let e = |l: f32| l.exp();
        let total = e(3.0) + 2.0 * e(2.0);
        assert!((weights[0] - e(3.0) / total).abs() < 1e-6);
        assert!((weights[1] - e(2.0) / total).abs() < 1e-6);
    }

    #[test]
    fn route_picks_distinct_experts_whatever_the_logits() {
        let nan = f32::NAN;
        let (mut experts, mut weights) = ([0; 3], [0.0; 3]);
        // A NaN weighs and ranks as negative infinity.
        route(&[nan, 1.0, nan, 0.0, -1.0], 3, &mut experts, &mut weights);
        assert_eq!(experts, [1, 3, 4]);
        let total = 1.0f32.exp() + 1.0 + (-1.0f32).exp();
        assert!((weights[0] - 1.0f32.exp() / total).abs() < 1e-6);
        // Fewer finite logits than k: the rest are the lowest-numbered others, each once.
        route(
            &[f32::NEG_INFINITY, nan, 2.0, f32::NEG_INFINITY],
            3,
            &mut experts,
            &mut weights,
        );
        assert_eq!(experts, [2, 0, 1]);
        assert_eq!(weights, [1.0, 0.0, 0.0]);
        // All NaN: the first k, and weights that are NaN too.
        route(&[nan; 5], 3, &mut experts, &mut weights);
        assert_eq!(experts, [0, 1, 2]);
        assert!(weights.iter().all(|w| w.is_nan()));
    }

    #[test]
    fn route_margin_is_the_gap_after_the_last_chosen_relative_to_the_largest_magnitude() {
        let logits = [0.1, 2.0, -4.0, 2.0, 0.5, 3.0];
        let route_margin = |logits: &[f32], k: usize| {
            let (mut chosen, mut weights) = (vec![0; k], vec![0.0; k]);
            route(logits, k, &mut chosen, &mut weights);
            super::route_margin(logits, &chosen)
        };
        assert_eq!(route_margin(&logits, 1), 1.0 / 4.0);
        assert_eq!(route_margin(&logits, 2), 0.0);
        assert_eq!(route_margin(&logits, 3), 1.5 / 4.0);
        assert_eq!(route_margin(&logits, 6), f32::INFINITY);
    }
}
