//! The sparse MoE block on the CPU: softmax router, top-k renormalised, SwiGLU experts read in place from the
//! stacked tensors, plus the sigmoid-gated shared expert.

use super::linalg::{matvecs, qmatmul, sigmoid, silu, MatVec};
use super::simd::QInput;
use crate::config::Config;
use crate::weights::Moe;

/// Softmax over the router logits, the `k` largest (lowest index first on ties), renormalised to sum to one.
pub fn route(logits: &[f32], k: usize, experts: &mut [usize], weights: &mut [f32]) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let denom: f32 = logits.iter().map(|l| (l - max).exp()).sum();
    let mut chosen_sum = 0.0;
    for slot in 0..k {
        let mut best = usize::MAX;
        for (e, l) in logits.iter().enumerate() {
            if !experts[..slot].contains(&e) && (best == usize::MAX || *l > logits[best]) {
                best = e;
            }
        }
        experts[slot] = best;
        weights[slot] = (logits[best] - max).exp() / denom;
        chosen_sum += weights[slot];
    }
    weights[..k].iter_mut().for_each(|w| *w /= chosen_sum);
}

/// SwiGLU of `tokens` rows of `x` through one expert given as row views; writes `[tokens][hidden]` to `out`.
fn expert_forward(
    gate: crate::quant::QView,
    up: crate::quant::QView,
    down: crate::quant::QView,
    x: &[f32],
    out: &mut [f32],
) {
    let tokens = x.len() / gate.cols;
    let inter = gate.rows;
    let mut g = vec![0.0; tokens * inter];
    let mut u = vec![0.0; tokens * inter];
    qmatmul(gate, x, &mut g);
    qmatmul(up, x, &mut u);
    for (gi, ui) in g.iter_mut().zip(&u) {
        *gi = silu(*gi) * ui;
    }
    qmatmul(down, &g, out);
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

/// `out = moe(x)` for `[tokens][hidden]` inputs; returns the smallest routing margin of its tokens.
pub fn moe_forward(moe: &Moe, num_experts: usize, top_k: usize, x: &[f32], out: &mut [f32]) -> f32 {
    let hidden = moe.router.cols;
    let tokens = x.len() / hidden;
    let inter = moe.experts_gate.rows / num_experts;

    let mut logits = vec![0.0; tokens * num_experts];
    qmatmul(moe.router.view(), x, &mut logits);
    let mut chosen = vec![0usize; tokens * top_k];
    let mut weights = vec![0.0f32; tokens * top_k];
    let mut margin = f32::INFINITY;
    for t in 0..tokens {
        let token_logits = &logits[t * num_experts..(t + 1) * num_experts];
        let token_chosen = &mut chosen[t * top_k..(t + 1) * top_k];
        route(
            token_logits,
            top_k,
            token_chosen,
            &mut weights[t * top_k..(t + 1) * top_k],
        );
        margin = margin.min(route_margin(token_logits, token_chosen));
    }

    // Shared expert, gated per token.
    expert_forward(
        moe.shared_gate.view(),
        moe.shared_up.view(),
        moe.shared_down.view(),
        x,
        out,
    );
    let mut shared_gate = vec![0.0; tokens];
    qmatmul(moe.shared_expert_gate.view(), x, &mut shared_gate);
    for t in 0..tokens {
        let s = sigmoid(shared_gate[t]);
        out[t * hidden..(t + 1) * hidden].iter_mut().for_each(|v| *v *= s);
    }

    // Routed experts: each expert runs once over the tokens that chose it.
    for e in 0..num_experts {
        let users: Vec<(usize, f32)> = (0..tokens * top_k)
            .filter(|&i| chosen[i] == e)
            .map(|i| (i / top_k, weights[i]))
            .collect();
        if users.is_empty() {
            continue;
        }
        let mut xe = Vec::with_capacity(users.len() * hidden);
        for (t, _) in &users {
            xe.extend_from_slice(&x[t * hidden..(t + 1) * hidden]);
        }
        let mut ye = vec![0.0; users.len() * hidden];
        expert_forward(
            moe.experts_gate.rows_view(e * inter, inter),
            moe.experts_up.rows_view(e * inter, inter),
            moe.experts_down.rows_view(e * hidden, hidden),
            &xe,
            &mut ye,
        );
        for (i, (t, w)) in users.iter().enumerate() {
            for j in 0..hidden {
                out[t * hidden + j] += w * ye[i * hidden + j];
            }
        }
    }
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

/// Most experts per token [`moe_decode`] takes (the model chooses 8).
const MAX_TOP_K: usize = 16;

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
