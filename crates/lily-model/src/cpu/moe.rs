//! The sparse MoE block on the CPU: softmax router, top-k renormalised, SwiGLU experts read in place from the
//! stacked tensors, plus the sigmoid-gated shared expert.

use super::linalg::{qmatmul, sigmoid, silu};
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

#[cfg(test)]
mod tests {
    use super::*;

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
