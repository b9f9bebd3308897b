//! Emulated reduced-precision numerics for the CPU forward pass: a study switch that rounds the inputs of the 4-bit
//! weight products, and the operands of the attention, the way a GPU kernel with narrower operands would, so that
//! the logit error of a candidate kernel format can be measured on the CPU before the kernel is written
//! (`cargo run --release -p lily-model --example numerics`).
//!
//! Both switches are process-wide and off ([`Rounding::Exact`], [`AttentionRounding::Exact`]) unless a caller sets
//! them; off, the forward pass is bit for bit what it is without this module. The products of several tokens
//! ([`super::linalg::gemms`]: a prompt's) read the first; a single token's products (quantized inputs of their own)
//! do not. The attention of [`super::attention::attend`] (every pass of [`super::model::CpuModel`]'s forward, a
//! one-token step's too) reads the second; the decode team's own attention does not.

use std::sync::RwLock;

use half::bf16;

/// How the inputs of the 4-bit weight products are rounded before the product (which then runs in f32).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rounding {
    /// f32, as the CPU reference computes.
    Exact,
    /// Each input rounded to bf16 (to nearest, ties to even): the GPU prompt path's products today.
    Bf16,
    /// One signed 8-bit integer per input, scaled per group of `group` inputs by max |x| / 127 (an int8 tensor-core
    /// product with the activations' group scale applied after each group).
    Int8 { group: usize },
    /// Two 8-bit digits per input, x = s (d0 + d1 / 128) with s = max |x| / 127 per group of `group` (the batched
    /// decode step's Q8x2 input codes).
    Int8x2 { group: usize },
    /// FP8 e4m3 per input, scaled per group of `group` inputs so that the group's largest magnitude maps to 448 (the
    /// largest e4m3 value); a group of 0 means the whole row (one scale per token).
    E4m3 { group: usize },
}

/// How the attention's operands are rounded: the queries, keys and values as they enter the two products, and the
/// softmax probabilities as they enter the second. Scores, the running maximum and the row sums stay f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionRounding {
    Exact,
    /// `scores`: the format of q and k; `values`: of v and the probabilities. `rotated` first turns each head of q
    /// and k by the same random orthogonal matrix (a Hadamard matrix times random signs), which leaves the scores
    /// as they are but spreads a few large dimensions over all of them before the rounding (FlashAttention-3's
    /// "incoherent processing").
    Rounded {
        scores: Operand,
        values: Operand,
        rotated: bool,
    },
}

impl AttentionRounding {
    /// Every operand in bf16: the GPU's KV cache and attention kernels today.
    pub const BF16: AttentionRounding = AttentionRounding::Rounded {
        scores: Operand::Bf16,
        values: Operand::Bf16,
        rotated: false,
    };
}

/// The format of a pair of the attention's operands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Operand {
    Bf16,
    /// FP8 e4m3. Scores: q and k with a scale per (token, head). Values: v with a scale per (head, block of 64
    /// positions), the probabilities (at most 1) without a scale, as FlashAttention-3's FP8 path feeds them.
    E4m3,
    /// 8-bit integers. Scores: q and k with a scale per (token, head), k after subtracting its mean over the
    /// positions (which moves every score of a query by the same amount, so the softmax not at all; SageAttention's
    /// smoothing). Values: v with a scale per (head, block of 64 positions), the probabilities with a scale per
    /// (query, block of 64 positions): multiples of the block's largest / 255 (a kernel knows each tile's largest
    /// score before it forms the probabilities, and rescales its output per row and tile for the online softmax
    /// anyway).
    Int8,
    /// Values only (as scores it is `E4m3`): v as in `E4m3`, the probabilities scaled per (query, block of 64
    /// positions) so that the block's largest is e4m3's largest, 448, before the rounding. A kernel accumulating in
    /// f32 gets this scaling for nothing: it folds each block's scale into the per-row rescaling of its output that
    /// the online softmax does anyway, so small probabilities keep e4m3's relative precision instead of falling
    /// into its subnormals (below 2^-6).
    E4m3Scaled,
}

/// The two switches, read once per product and per attention call.
static SWITCHES: RwLock<(Rounding, AttentionRounding)> = RwLock::new((Rounding::Exact, AttentionRounding::Exact));

fn switches() -> (Rounding, AttentionRounding) {
    *SWITCHES.read().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn set_switches(change: impl FnOnce(&mut (Rounding, AttentionRounding))) {
    change(&mut SWITCHES.write().unwrap_or_else(|poisoned| poisoned.into_inner()));
}

impl Rounding {
    /// Rounds one row of inputs in place.
    pub fn round(self, row: &mut [f32]) {
        let groups = |group: usize| if group == 0 { row.len().max(1) } else { group };
        match self {
            Rounding::Exact => {}
            Rounding::Bf16 => row.iter_mut().for_each(|v| *v = bf16::from_f32(*v).to_f32()),
            Rounding::Int8 { group } => row.chunks_mut(groups(group)).for_each(|g| int8_group(g, false)),
            Rounding::Int8x2 { group } => row.chunks_mut(groups(group)).for_each(|g| int8_group(g, true)),
            Rounding::E4m3 { group } => row.chunks_mut(groups(group)).for_each(e4m3_group),
        }
    }
}

/// Sets how the prompt path's 4-bit products round their inputs (process-wide).
pub fn set_products(rounding: Rounding) {
    set_switches(|s| s.0 = rounding);
}

/// How the prompt path's 4-bit products round their inputs.
pub fn products() -> Rounding {
    switches().0
}

/// Sets how the attention rounds its operands (process-wide).
pub fn set_attention(rounding: AttentionRounding) {
    set_switches(|s| s.1 = rounding);
}

/// How the attention rounds its operands.
pub fn attention() -> AttentionRounding {
    switches().1
}

/// Turns `x` (a power-of-two length) by the orthogonal matrix H diag(signs) / sqrt(n), H the Sylvester Hadamard
/// matrix: x <- H (signs * x) / sqrt(n), by the fast Walsh-Hadamard transform. `signs` are +-1.
pub fn rotate(x: &mut [f32], signs: &[f32]) {
    let n = x.len();
    assert!(n.is_power_of_two() && signs.len() == n);
    x.iter_mut().zip(signs).for_each(|(v, s)| *v *= s);
    let mut half = 1;
    while half < n {
        for block in x.chunks_exact_mut(2 * half) {
            let (a, b) = block.split_at_mut(half);
            for (a, b) in a.iter_mut().zip(b) {
                (*a, *b) = (*a + *b, *a - *b);
            }
        }
        half *= 2;
    }
    let norm = 1.0 / (n as f32).sqrt();
    x.iter_mut().for_each(|v| *v *= norm);
}

/// The largest finite e4m3 value.
pub const E4M3_MAX: f32 = 448.0;

/// Rounds `v` to the nearest e4m3 value (ties to even), saturating at +-448: 3 mantissa bits, normal exponents
/// -6 ..= 8, subnormals in steps of 2^-9.
pub fn e4m3(v: f32) -> f32 {
    let a = v.abs();
    if a == 0.0 || a.is_nan() {
        return v;
    }
    // The spacing of e4m3 values around a: 2^(e - 3) for a normal a in [2^e, 2^(e + 1)), 2^-9 below 2^-6.
    let exponent = ((a.to_bits() >> 23) & 0xff) as i32 - 127;
    let step = ((exponent.max(-6) - 3) as f32).exp2();
    let rounded = (a / step).round_ties_even() * step;
    rounded.min(E4M3_MAX).copysign(v)
}

/// Rounds a group to e4m3 with one scale, max |x| / 448.
fn e4m3_group(group: &mut [f32]) {
    let max = group.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    if max == 0.0 {
        return;
    }
    let scale = max / E4M3_MAX;
    group.iter_mut().for_each(|v| *v = e4m3(*v / scale) * scale);
}

/// Rounds a group to one (or, with `two_digits`, two) 8-bit digits with one scale, max |x| / 127.
fn int8_group(group: &mut [f32], two_digits: bool) {
    let max = group.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    if max == 0.0 {
        return;
    }
    let (up, scale) = (127.0 / max, max / 127.0);
    for v in group.iter_mut() {
        let y = *v * up;
        let d0 = y.round_ties_even();
        let d1 = if two_digits {
            ((y - d0) * 128.0).round_ties_even()
        } else {
            0.0
        };
        *v = (d0 + d1 / 128.0) * scale;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_rounds_to_the_format_s_values() {
        // Exact values stay, including the extremes and a subnormal.
        for v in [0.0, 1.0, -1.5, 448.0, -448.0, 0.015625, 0.001953125, 240.0, 0.875] {
            assert_eq!(e4m3(v), v, "{v}");
        }
        // Between 1 and 2 the step is 1/8; ties go to the even mantissa.
        assert_eq!(e4m3(1.0 + 1.0 / 16.0), 1.0);
        assert_eq!(e4m3(1.0 + 3.0 / 16.0), 1.25);
        assert_eq!(e4m3(1.07), 1.125);
        // Saturation, and subnormal steps of 2^-9 below 2^-6.
        assert_eq!(e4m3(1000.0), 448.0);
        assert_eq!(e4m3(-0.0025), -0.001953125);
        assert_eq!(e4m3(0.0009), 0.0);
        // The relative error of a normal value is at most half a step: 2^-4.
        for i in 1..2000 {
            let v = 0.02 * i as f32 + 0.0137;
            assert!((e4m3(v) - v).abs() <= v / 16.0 + 1e-7, "{v} -> {}", e4m3(v));
        }
    }

    #[test]
    fn rotation_keeps_dot_products_and_spreads_a_spike() {
        let mut rng = crate::rng::Rng::new(3);
        let signs: Vec<f32> = (0..256).map(|_| if rng.uniform() < 0.5 { -1.0 } else { 1.0 }).collect();
        let a: Vec<f32> = (0..256).map(|_| rng.normal()).collect();
        let b: Vec<f32> = (0..256).map(|_| rng.normal()).collect();
        let dot = |x: &[f32], y: &[f32]| x.iter().zip(y).map(|(x, y)| x * y).sum::<f32>();
        let (mut ra, mut rb) = (a.clone(), b.clone());
        rotate(&mut ra, &signs);
        rotate(&mut rb, &signs);
        assert!(
            (dot(&a, &b) - dot(&ra, &rb)).abs() < 1e-3,
            "{} {}",
            dot(&a, &b),
            dot(&ra, &rb)
        );
        assert!((dot(&a, &a) - dot(&ra, &ra)).abs() < 1e-3);
        let mut spike = vec![0.0; 256];
        spike[17] = 16.0;
        rotate(&mut spike, &signs);
        assert!(spike.iter().all(|v| (v.abs() - 1.0).abs() < 1e-6));
    }

    #[test]
    fn groups_round_with_their_own_scale() {
        let row: Vec<f32> = (0..128)
            .map(|i| ((i as f32) * 0.37).sin() * if i < 64 { 100.0 } else { 0.01 })
            .collect();
        for rounding in [
            Rounding::Bf16,
            Rounding::Int8 { group: 64 },
            Rounding::Int8x2 { group: 64 },
            Rounding::E4m3 { group: 64 },
            Rounding::E4m3 { group: 0 },
        ] {
            let mut r = row.clone();
            rounding.round(&mut r);
            let worst = |range: std::ops::Range<usize>| {
                let max = row[range.clone()].iter().fold(0.0f32, |m, v| m.max(v.abs()));
                range.map(|i| (r[i] - row[i]).abs()).fold(0.0, f32::max) / max
            };
            // Each group's error relative to its own largest value.
            let bound = match rounding {
                Rounding::Bf16 => 1.0 / 256.0,
                Rounding::Int8 { .. } => 0.5 / 127.0,
                Rounding::Int8x2 { .. } => 0.5 / 127.0 / 128.0,
                Rounding::E4m3 { .. } => 1.0 / 16.0,
                Rounding::Exact => 0.0,
            };
            assert!(worst(0..64) <= bound * 1.0001, "{rounding:?}: {}", worst(0..64));
            assert!(worst(64..128) <= bound * 1.0001, "{rounding:?}: {}", worst(64..128));
        }
        // Integers scale by the group's largest value: with one group for the row, the small half (10^4 times
        // smaller) keeps only a few levels. e4m3 is a float: one scale for the row still holds the small half to
        // 1/16 of itself, and only values below its range (2^-9 / 448 of the largest) vanish.
        let mut one_group = row.clone();
        Rounding::Int8 { group: 0 }.round(&mut one_group);
        assert!(one_group[64..].iter().all(|&v| v == 0.0));
        let mut tiny = row.clone();
        tiny[100] = 1e-7;
        Rounding::E4m3 { group: 0 }.round(&mut tiny);
        assert_eq!(tiny[100], 0.0);
    }
}
