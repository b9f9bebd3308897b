//! Gated DeltaNet on the CPU: the causal depthwise conv, the per-token recurrence (decode) and the chunked WY form
//! (prefill, chunk 64), which computes the same function with matrix products.

/// Tokens per chunk in the chunked form.
pub const CHUNK: usize = 64;

/// One token through the causal depthwise conv, then SiLU. `state` holds the previous `taps - 1` inputs, oldest
/// first (`[taps - 1][channels]`), and is shifted to include `x`.
pub fn conv_step(x: &[f32], state: &mut [f32], weights: &[f32], taps: usize, out: &mut [f32]) {
    let channels = x.len();
    for c in 0..channels {
        let w = &weights[c * taps..(c + 1) * taps];
        let mut acc = w[taps - 1] * x[c];
        for j in 0..taps - 1 {
            acc += w[j] * state[j * channels + c];
        }
        out[c] = super::linalg::silu(acc);
    }
    state.copy_within(channels.., 0);
    state[(taps - 2) * channels..].copy_from_slice(x);
}

/// `tokens` inputs (`[tokens][channels]`) through the conv, continuing from `state` and leaving it after the last.
pub fn conv_sequence(x: &[f32], state: &mut [f32], weights: &[f32], taps: usize, channels: usize, out: &mut [f32]) {
    for (xt, ot) in x.chunks_exact(channels).zip(out.chunks_exact_mut(channels)) {
        conv_step(xt, state, weights, taps, ot);
    }
}

/// `x * rsqrt(sum(x^2) + 1e-6)`.
pub fn l2norm(x: &mut [f32]) {
    let inv = 1.0 / (x.iter().map(|v| v * v).sum::<f32>() + 1e-6).sqrt();
    x.iter_mut().for_each(|v| *v *= inv);
}

/// One token of one value head: `S *= exp(g); u = (v - S^T k) * beta; S += k u^T; o = S^T q`.
/// `state` is `[dk][dv]`; q must already be l2-normalised and scaled by `1/sqrt(dk)`, k l2-normalised.
pub fn recurrent_step(q: &[f32], k: &[f32], v: &[f32], g: f32, beta: f32, state: &mut [f32], out: &mut [f32]) {
    let (dk, dv) = (k.len(), v.len());
    let decay = g.exp();
    let mut kv_mem = [0.0f32; 256];
    let kv_mem = &mut kv_mem[..dv];
    for i in 0..dk {
        let row = &mut state[i * dv..(i + 1) * dv];
        for j in 0..dv {
            row[j] *= decay;
            kv_mem[j] += row[j] * k[i];
        }
    }
    for j in 0..dv {
        kv_mem[j] = (v[j] - kv_mem[j]) * beta;
    }
    out.fill(0.0);
    for i in 0..dk {
        let row = &mut state[i * dv..(i + 1) * dv];
        for j in 0..dv {
            row[j] += k[i] * kv_mem[j];
            out[j] += row[j] * q[i];
        }
    }
}

/// A sequence of one value head in chunks of [`CHUNK`]: the same result as [`recurrent_step`] for each token.
/// `q`, `k` are `[tokens][dk]`, `v` and `out` `[tokens][dv]`; `g`, `beta` per token.
pub fn chunked(q: &[f32], k: &[f32], v: &[f32], g: &[f32], beta: &[f32], state: &mut [f32], out: &mut [f32]) {
    let tokens = g.len();
    let dk = k.len() / tokens;
    let dv = v.len() / tokens;
    let mut start = 0;
    while start < tokens {
        let n = CHUNK.min(tokens - start);
        chunk(
            &q[start * dk..(start + n) * dk],
            &k[start * dk..(start + n) * dk],
            &v[start * dv..(start + n) * dv],
            &g[start..start + n],
            &beta[start..start + n],
            state,
            &mut out[start * dv..(start + n) * dv],
        );
        start += n;
    }
}

/// One chunk of `n <= CHUNK` tokens in the WY form. With `c_t` the cumulative log decay within the chunk:
///   A[t][s] = beta_t (k_t . k_s) exp(c_t - c_s) for s < t;  (I + A) U = beta*v;  (I + A) W = beta*k*exp(c)
///   V' = U - W S;  o_t = exp(c_t) q_t S + sum_{s<=t} (q_t . k_s) exp(c_t - c_s) V'_s
///   S <- exp(c_last) S + sum_s exp(c_last - c_s) k_s V'_s^T
fn chunk(q: &[f32], k: &[f32], v: &[f32], g: &[f32], beta: &[f32], state: &mut [f32], out: &mut [f32]) {
    let n = g.len();
    let dk = k.len() / n;
    let dv = v.len() / n;
    let mut cum = [0.0f32; CHUNK];
    let mut acc = 0.0;
    for t in 0..n {
        acc += g[t];
        cum[t] = acc;
    }
    // Strictly lower-triangular A, then forward substitution for U (n x dv) and W (n x dk).
    let mut a = vec![0.0f32; n * n];
    for t in 0..n {
        for s in 0..t {
            let kk = super::linalg::dot(&k[t * dk..(t + 1) * dk], &k[s * dk..(s + 1) * dk]);
            a[t * n + s] = beta[t] * kk * (cum[t] - cum[s]).exp();
        }
    }
    let mut u = vec![0.0f32; n * dv];
    let mut w = vec![0.0f32; n * dk];
    for t in 0..n {
        for j in 0..dv {
            u[t * dv + j] = beta[t] * v[t * dv + j];
        }
        let e = beta[t] * cum[t].exp();
        for i in 0..dk {
            w[t * dk + i] = e * k[t * dk + i];
        }
        for s in 0..t {
            let coef = a[t * n + s];
            if coef != 0.0 {
                for j in 0..dv {
                    u[t * dv + j] -= coef * u[s * dv + j];
                }
                for i in 0..dk {
                    w[t * dk + i] -= coef * w[s * dk + i];
                }
            }
        }
    }
    // V' = U - W S, and the read of the incoming state by the decayed queries.
    let mut v_new = u;
    for t in 0..n {
        let qe = cum[t].exp();
        let o = &mut out[t * dv..(t + 1) * dv];
        o.fill(0.0);
        for i in 0..dk {
            let srow = &state[i * dv..(i + 1) * dv];
            let wi = w[t * dk + i];
            let qi = q[t * dk + i] * qe;
            for j in 0..dv {
                v_new[t * dv + j] -= wi * srow[j];
                o[j] += qi * srow[j];
            }
        }
    }
    // Intra-chunk attention, causal including the diagonal.
    for t in 0..n {
        for s in 0..=t {
            let coef = super::linalg::dot(&q[t * dk..(t + 1) * dk], &k[s * dk..(s + 1) * dk]) * (cum[t] - cum[s]).exp();
            for j in 0..dv {
                out[t * dv + j] += coef * v_new[s * dv + j];
            }
        }
    }
    let last = cum[n - 1];
    let chunk_decay = last.exp();
    state.iter_mut().for_each(|x| *x *= chunk_decay);
    for s in 0..n {
        let e = (last - cum[s]).exp();
        for i in 0..dk {
            let ki = k[s * dk + i] * e;
            let srow = &mut state[i * dv..(i + 1) * dv];
            for j in 0..dv {
                srow[j] += ki * v_new[s * dv + j];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    #[test]
    fn chunked_form_equals_the_recurrence() {
        let mut rng = Rng::new(11);
        let (dk, dv) = (32, 48);
        for tokens in [1, 5, 64, 65, 150] {
            let mut q: Vec<f32> = (0..tokens * dk).map(|_| rng.normal()).collect();
            let mut k: Vec<f32> = (0..tokens * dk).map(|_| rng.normal()).collect();
            for t in 0..tokens {
                l2norm(&mut q[t * dk..(t + 1) * dk]);
                l2norm(&mut k[t * dk..(t + 1) * dk]);
            }
            let v: Vec<f32> = (0..tokens * dv).map(|_| rng.normal()).collect();
            let g: Vec<f32> = (0..tokens).map(|_| -0.3 * rng.uniform()).collect();
            let beta: Vec<f32> = (0..tokens).map(|_| rng.uniform()).collect();
            let initial: Vec<f32> = (0..dk * dv).map(|_| 0.1 * rng.normal()).collect();

            let mut s_ref = initial.clone();
            let mut o_ref = vec![0.0; tokens * dv];
            for t in 0..tokens {
                recurrent_step(
                    &q[t * dk..(t + 1) * dk],
                    &k[t * dk..(t + 1) * dk],
                    &v[t * dv..(t + 1) * dv],
                    g[t],
                    beta[t],
                    &mut s_ref,
                    &mut o_ref[t * dv..(t + 1) * dv],
                );
            }
            let mut s = initial.clone();
            let mut o = vec![f32::NAN; tokens * dv];
            chunked(&q, &k, &v, &g, &beta, &mut s, &mut o);
            let max_o = o.iter().zip(&o_ref).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
            let max_s = s.iter().zip(&s_ref).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
            assert!(
                max_o < 1e-4 && max_s < 1e-4,
                "tokens {tokens}: out {max_o} state {max_s}"
            );
        }
    }

    #[test]
    fn conv_sequence_continues_from_its_state() {
        let mut rng = Rng::new(5);
        let (channels, taps, tokens) = (6, 4, 9);
        let w: Vec<f32> = (0..channels * taps).map(|_| rng.normal()).collect();
        let x: Vec<f32> = (0..tokens * channels).map(|_| rng.normal()).collect();
        let mut state_all = vec![0.0; (taps - 1) * channels];
        let mut out_all = vec![0.0; tokens * channels];
        conv_sequence(&x, &mut state_all, &w, taps, channels, &mut out_all);
        let mut state = vec![0.0; (taps - 1) * channels];
        let mut out = vec![0.0; tokens * channels];
        conv_sequence(
            &x[..4 * channels],
            &mut state,
            &w,
            taps,
            channels,
            &mut out[..4 * channels],
        );
        conv_sequence(
            &x[4 * channels..],
            &mut state,
            &w,
            taps,
            channels,
            &mut out[4 * channels..],
        );
        assert_eq!(out, out_all);
        assert_eq!(state, state_all);
        // Direct definition for the last token of channel 2.
        let t = tokens - 1;
        let direct: f32 = (0..taps)
            .map(|j| w[2 * taps + j] * x[(t + 1 + j - taps) * channels + 2])
            .sum();
        assert!((out_all[t * channels + 2] - crate::cpu::linalg::silu(direct)).abs() < 1e-6);
    }
}
