//! Gated full attention on the CPU: partial NeoX RoPE and causal softmax attention of GQA query heads over the
//! KV cache.

use std::cell::RefCell;

use half::bf16;
use rayon::prelude::*;

use super::numerics::{e4m3, rotate, AttentionRounding, Operand, Rounding};

thread_local! {
    /// Per thread, the scores of the query head it last attended with: reused so that a decode step allocates
    /// nothing once a thread has seen the longest context.
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Rotates the first `2 * inv_freq.len()` dims of one head in place: pairs (i, i + half).
pub fn rope(head: &mut [f32], position: usize, inv_freq: &[f32]) {
    let half = inv_freq.len();
    for i in 0..half {
        let angle = position as f32 * inv_freq[i];
        let (sin, cos) = angle.sin_cos();
        let (a, b) = (head[i], head[i + half]);
        head[i] = a * cos - b * sin;
        head[i + half] = b * cos + a * sin;
    }
}

/// Causal attention for `tokens` new queries at positions `start..start + tokens`, over a cache that already
/// holds their keys and values (`[position][kv_heads * head_dim]`). `q` is `[tokens][heads * head_dim]`.
pub fn attend(
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    start: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    out: &mut [f32],
) {
    let group = heads / kv_heads;
    let scale = 1.0 / (head_dim as f32).sqrt();
    let kv_dim = kv_heads * head_dim;
    let rounding = super::numerics::attention();
    if rounding != AttentionRounding::Exact {
        return attend_rounded(q, k_cache, v_cache, start, heads, kv_heads, head_dim, out, rounding);
    }
    out.par_chunks_mut(head_dim).enumerate().for_each(|(index, o)| {
        let (t, h) = (index / heads, index % heads);
        let qh = &q[(t * heads + h) * head_dim..(t * heads + h + 1) * head_dim];
        attend_head(qh, k_cache, v_cache, start + t + 1, h / group, kv_dim, scale, o);
    });
}

/// One query head's attention over the first `visible` positions of the cache, with the keys and values of KV head
/// `kvh`; `scale` multiplies the scores.
#[allow(clippy::too_many_arguments)]
pub fn attend_head(
    qh: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    visible: usize,
    kvh: usize,
    kv_dim: usize,
    scale: f32,
    o: &mut [f32],
) {
    let head_dim = qh.len();
    // Taken out of the thread-local for the head (a nested use would start an empty one, not find it borrowed).
    let mut scores = SCORES.with(|s| std::mem::take(&mut *s.borrow_mut()));
    scores.clear();
    let mut max = f32::NEG_INFINITY;
    for p in 0..visible {
        let k = &k_cache[p * kv_dim + kvh * head_dim..p * kv_dim + (kvh + 1) * head_dim];
        let s = super::linalg::dot(qh, k) * scale;
        max = max.max(s);
        scores.push(s);
    }
    let mut denom = 0.0;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        denom += *s;
    }
    o.fill(0.0);
    for (p, s) in scores.iter().enumerate() {
        let v = &v_cache[p * kv_dim + kvh * head_dim..p * kv_dim + (kvh + 1) * head_dim];
        let w = s / denom;
        for j in 0..head_dim {
            o[j] += w * v[j];
        }
    }
    SCORES.with(|s| *s.borrow_mut() = scores);
}

/// [`attend`] with its operands rounded as `rounding` says (the study switch of [`super::numerics`]): the same
/// softmax, over rounded copies of the queries, keys and values, with each probability rounded before it weighs
/// its value row and the row sum taken before the rounding (as a kernel sums the f32 probabilities).
#[allow(clippy::too_many_arguments)]
fn attend_rounded(
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    start: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    out: &mut [f32],
    rounding: AttentionRounding,
) {
    /// Positions that share one scale of the values, and in int8 of a query's probabilities: a kernel's tile of keys.
    const V_BLOCK: usize = 64;
    let (group, kv_dim) = (heads / kv_heads, kv_heads * head_dim);
    let scale = 1.0 / (head_dim as f32).sqrt();
    let AttentionRounding::Rounded {
        scores,
        values,
        rotated,
    } = rounding
    else {
        unreachable!("the exact attention is attend's own")
    };
    let positions = v_cache.len() / kv_dim;
    let mut q = q.to_vec();
    let mut k = k_cache.to_vec();
    if rotated {
        // The same signs for every head and call, from a fixed seed: a kernel would hold one such matrix.
        let mut rng = crate::rng::Rng::new(0x4ad4);
        let signs: Vec<f32> = (0..head_dim)
            .map(|_| if rng.uniform() < 0.5 { -1.0 } else { 1.0 })
            .collect();
        q.chunks_mut(head_dim).for_each(|h| rotate(h, &signs));
        k.chunks_mut(head_dim).for_each(|h| rotate(h, &signs));
    }
    if scores == Operand::Int8 {
        // Each KV head's mean key over the cache, subtracted from its keys.
        for kvh in 0..kv_heads {
            let mut mean = vec![0.0f32; head_dim];
            for p in 0..positions {
                let row = &k[p * kv_dim + kvh * head_dim..][..head_dim];
                mean.iter_mut().zip(row).for_each(|(m, x)| *m += x / positions as f32);
            }
            for p in 0..positions {
                let row = &mut k[p * kv_dim + kvh * head_dim..][..head_dim];
                row.iter_mut().zip(&mean).for_each(|(x, m)| *x -= m);
            }
        }
    }
    let per_head = match scores {
        Operand::Bf16 => Rounding::Bf16,
        Operand::E4m3 | Operand::E4m3Scaled => Rounding::E4m3 { group: head_dim },
        Operand::Int8 => Rounding::Int8 { group: head_dim },
    };
    q.chunks_mut(head_dim).for_each(|h| per_head.round(h));
    k.chunks_mut(head_dim).for_each(|h| per_head.round(h));
    let mut v = v_cache.to_vec();
    if values == Operand::Bf16 {
        Rounding::Bf16.round(&mut v);
    } else {
        // One scale per KV head and block of positions.
        for kvh in 0..kv_heads {
            for block in (0..positions).step_by(V_BLOCK) {
                let mut values_of_block: Vec<f32> = (block..(block + V_BLOCK).min(positions))
                    .flat_map(|p| v[p * kv_dim + kvh * head_dim..][..head_dim].iter().copied())
                    .collect();
                match values {
                    Operand::Bf16 => unreachable!("rounded above"),
                    Operand::E4m3 | Operand::E4m3Scaled => Rounding::E4m3 { group: 0 }.round(&mut values_of_block),
                    Operand::Int8 => Rounding::Int8 { group: 0 }.round(&mut values_of_block),
                }
                for (i, row) in values_of_block.chunks_exact(head_dim).enumerate() {
                    let p = block + i;
                    v[p * kv_dim + kvh * head_dim..][..head_dim].copy_from_slice(row);
                }
            }
        }
    }
    let (q, k, v) = (&q, &k, &v);
    out.par_chunks_mut(head_dim).enumerate().for_each(|(index, o)| {
        let (t, h) = (index / heads, index % heads);
        let kvh = h / group;
        let qh = &q[(t * heads + h) * head_dim..(t * heads + h + 1) * head_dim];
        let visible = start + t + 1;
        let at = |p: usize| p * kv_dim + kvh * head_dim..p * kv_dim + (kvh + 1) * head_dim;
        let scores: Vec<f32> = (0..visible)
            .map(|p| super::linalg::dot(qh, &k[at(p)]) * scale)
            .collect();
        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let weights: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
        let denom: f32 = weights.iter().sum();
        o.fill(0.0);
        // The probabilities as the output's product takes them, a block of positions at a time (int8: in
        // multiples of the block's largest / 255; scaled e4m3: the block's largest at 448).
        for (block, weights) in weights.chunks(V_BLOCK).enumerate() {
            let block_max = weights.iter().copied().fold(0.0f32, f32::max);
            for (i, w) in weights.iter().enumerate() {
                let w = match values {
                    Operand::Bf16 => bf16::from_f32(*w).to_f32(),
                    Operand::E4m3 => e4m3(*w),
                    Operand::E4m3Scaled => e4m3(w * (448.0 / block_max)) * (block_max / 448.0),
                    Operand::Int8 => (w / block_max * 255.0).round_ties_even() * block_max / 255.0,
                };
                for (o, v) in o.iter_mut().zip(&v[at(block * V_BLOCK + i)]) {
                    *o += w * v;
                }
            }
        }
        o.iter_mut().for_each(|x| *x /= denom);
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::derived::rope_inv_freq;
    use crate::rng::Rng;

    #[test]
    fn rope_preserves_norm_and_is_relative() {
        let inv = rope_inv_freq(1e7, 64);
        let mut rng = Rng::new(1);
        let q: Vec<f32> = (0..256).map(|_| rng.normal()).collect();
        let k: Vec<f32> = (0..256).map(|_| rng.normal()).collect();
        let rotated_dot = |pq: usize, pk: usize| {
            let (mut a, mut b) = (q.clone(), k.clone());
            rope(&mut a, pq, &inv);
            rope(&mut b, pk, &inv);
            crate::cpu::linalg::dot(&a, &b)
        };
        assert!((rotated_dot(10, 3) - rotated_dot(107, 100)).abs() < 1e-3);
        let mut a = q.clone();
        rope(&mut a, 12345, &inv);
        let n0: f32 = q.iter().map(|v| v * v).sum();
        let n1: f32 = a.iter().map(|v| v * v).sum();
        assert!((n0 - n1).abs() < 1e-3 * n0);
        assert_eq!(&a[64..], &q[64..]);
    }

    #[test]
    fn one_visible_position_returns_its_value() {
        let v: Vec<f32> = (0..8).map(|i| i as f32).collect();
        let k = vec![1.0; 8];
        let q = vec![0.5; 16];
        let mut out = vec![0.0; 16];
        attend(&q, &k, &v, 0, 2, 1, 8, &mut out);
        assert_eq!(&out[..8], &v[..]);
        assert_eq!(&out[8..], &v[..]);
    }
}
