//! Gated DeltaNet on the CPU: the causal depthwise conv, the per-token recurrence (decode) and the chunked WY form
//! (prefill, chunk 64), which computes the same function with matrix products.

use rayon::prelude::*;

use super::simd::Path;
use super::team::Shared;
use crate::weights::GatedDeltaNet;

/// Most conv taps [`decode_key_head`] takes (the model has 4; the config refuses more).
const MAX_TAPS: usize = crate::config::MAX_CONV_TAPS;

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
/// Each output depends on inputs alone, so the tokens run in parallel, each summed in the order of [`conv_step`].
pub fn conv_sequence(x: &[f32], state: &mut [f32], weights: &[f32], taps: usize, channels: usize, out: &mut [f32]) {
    let history = taps - 1;
    let tokens = x.len() / channels;
    {
        let state = &*state;
        // Row `i` of the inputs that the state's rows begin.
        let input = |i: usize| {
            if i < history {
                &state[i * channels..(i + 1) * channels]
            } else {
                &x[(i - history) * channels..(i - history + 1) * channels]
            }
        };
        out[..tokens * channels]
            .par_chunks_mut(channels)
            .enumerate()
            .for_each(|(t, o)| {
                let newest = input(t + history);
                let older: Vec<&[f32]> = (t..t + history).map(input).collect();
                for c in 0..channels {
                    let w = &weights[c * taps..(c + 1) * taps];
                    let mut acc = w[taps - 1] * newest[c];
                    for (j, older) in older.iter().enumerate() {
                        acc += w[j] * older[c];
                    }
                    o[c] = super::linalg::silu(acc);
                }
            });
    }
    // The state becomes the last `taps - 1` inputs.
    if tokens >= history {
        state.copy_from_slice(&x[(tokens - history) * channels..tokens * channels]);
    } else {
        state.copy_within(tokens * channels.., 0);
        state[(history - tokens) * channels..].copy_from_slice(x);
    }
}

/// The inputs of one token's DeltaNet heads in a decode step ([`decode_key_head`]): the projections of the token
/// (`qkv`: `[conv_dim]` before the conv; `z`: `[value heads][dv]`; `b`, `a`: per value head, before their
/// activations) and the layer's weights.
pub struct DecodeInputs<'a> {
    pub weights: &'a GatedDeltaNet,
    pub key_heads: usize,
    pub value_heads: usize,
    pub dk: usize,
    pub dv: usize,
    pub taps: usize,
    pub eps: f32,
    pub qkv: &'a [f32],
    pub z: &'a [f32],
    pub b: &'a [f32],
    pub a: &'a [f32],
}

/// One token through the value heads that read key head `kh`: the conv and SiLU of the key head's q and k channels
/// and of these value heads' v channels (each channel's conv state shifted), q and k l2-normalised (q scaled by
/// `1 / sqrt(dk)`), the gates `beta = sigmoid(b)` and `g = -exp(a_log) * softplus(a + dt_bias)`, the recurrence
/// ([`recurrent_step`]) and the gated RMSNorm `norm * rmsnorm(o) * silu(z)` into `core` (`[value heads][dv]`).
/// The operations and their order are those of the whole-layer steps of a prompt of one token. Touches only the
/// channels of `conv_state` and `conv_out`, the blocks of `recurrent` and the heads of `core` of these heads.
pub fn decode_key_head(
    inputs: &DecodeInputs,
    kh: usize,
    conv_state: Shared<[f32]>,
    conv_out: Shared<[f32]>,
    recurrent: Shared<[f32]>,
    core: Shared<[f32]>,
) {
    let DecodeInputs {
        weights,
        key_heads,
        value_heads,
        dk,
        dv,
        taps,
        ..
    } = *inputs;
    let key_dim = key_heads * dk;
    let channels = inputs.qkv.len();
    let heads_per_key = value_heads / key_heads;
    let heads = kh * heads_per_key..(kh + 1) * heads_per_key;
    let history = taps - 1;
    assert!((2..=MAX_TAPS).contains(&taps), "{taps} conv taps");
    // SAFETY (every `part` below): the channels of key head `kh` and of its value heads, and those value heads'
    // state blocks and outputs, belong to this call alone.
    let conv = |start: usize, len: usize| {
        let out = unsafe { conv_out.part(start, len) };
        let rows: [&mut [f32]; MAX_TAPS - 1] = std::array::from_fn(|j| {
            if j < history {
                unsafe { conv_state.part(j * channels + start, len) }
            } else {
                &mut []
            }
        });
        for (i, o) in out.iter_mut().enumerate() {
            let c = start + i;
            let w = &weights.conv1d[c * taps..(c + 1) * taps];
            let x = inputs.qkv[c];
            let mut acc = w[taps - 1] * x;
            for j in 0..history {
                acc += w[j] * rows[j][i];
            }
            *o = super::linalg::silu(acc);
        }
        let mut rows = rows;
        for j in 0..history - 1 {
            let (older, newer) = rows.split_at_mut(j + 1);
            older[j].copy_from_slice(newer[0]);
        }
        rows[history - 1].copy_from_slice(&inputs.qkv[start..start + len]);
        out
    };
    let q = conv(kh * dk, dk);
    let k = conv(key_dim + kh * dk, dk);
    let v = conv(2 * key_dim + heads.start * dv, heads.len() * dv);
    l2norm(q);
    l2norm(k);
    let q_scale = 1.0 / (dk as f32).sqrt();
    q.iter_mut().for_each(|v| *v *= q_scale);
    let states = unsafe { recurrent.part(heads.start * dk * dv, heads.len() * dk * dv) };
    let outs = unsafe { core.part(heads.start * dv, heads.len() * dv) };
    for (i, ((s, out), v)) in states
        .chunks_exact_mut(dk * dv)
        .zip(outs.chunks_exact_mut(dv))
        .zip(v.chunks_exact(dv))
        .enumerate()
    {
        let head = heads.start + i;
        let beta = super::linalg::sigmoid(inputs.b[head]);
        let decay = -weights.a_log[head].exp() * super::linalg::softplus(inputs.a[head] + weights.dt_bias[head]);
        recurrent_step(q, k, v, decay, beta, s, out);
        super::linalg::rmsnorm_row_in_place(out, &weights.norm, inputs.eps);
        for (o, z) in out.iter_mut().zip(&inputs.z[head * dv..(head + 1) * dv]) {
            *o *= super::linalg::silu(*z);
        }
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
/// `q`, `k` are `[tokens][dk]`, `v` and `out` `[tokens][dv]`; `g` (the log decays, at most zero), `beta` per token. The matrix products run on
/// the vector width of the SIMD path ([`super::linalg::simd_path`]).
pub fn chunked(q: &[f32], k: &[f32], v: &[f32], g: &[f32], beta: &[f32], state: &mut [f32], out: &mut [f32]) {
    chunked_on(super::linalg::simd_path(), q, k, v, g, beta, state, out)
}

/// [`chunked`] on `path`, which must be available (see [`Path::is_available`]).
#[allow(clippy::too_many_arguments)]
fn chunked_on(
    path: Path,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    state: &mut [f32],
    out: &mut [f32],
) {
    assert!(
        path.is_available(),
        "the {} path needs CPU features this CPU lacks",
        path.name()
    );
    match path {
        // SAFETY (each arm): the path is available on this CPU, so it has the features the function is compiled
        // for.
        #[cfg(target_arch = "x86_64")]
        Path::Avx512 => unsafe { chunked_avx512(q, k, v, g, beta, state, out) },
        #[cfg(target_arch = "x86_64")]
        Path::Avx2 => unsafe { chunked_avx2(q, k, v, g, beta, state, out) },
        _ => chunked_with::<Portable>(q, k, v, g, beta, state, out),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,avx512f,avx512vl")]
unsafe fn chunked_avx512(q: &[f32], k: &[f32], v: &[f32], g: &[f32], beta: &[f32], state: &mut [f32], out: &mut [f32]) {
    chunked_with::<x86::Avx512>(q, k, v, g, beta, state, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn chunked_avx2(q: &[f32], k: &[f32], v: &[f32], g: &[f32], beta: &[f32], state: &mut [f32], out: &mut [f32]) {
    chunked_with::<x86::Avx2>(q, k, v, g, beta, state, out)
}

/// [`chunked`] on the vectors of `S` (inlined into each caller, so compiled with its features).
#[inline(always)]
fn chunked_with<S: Vector>(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    state: &mut [f32],
    out: &mut [f32],
) {
    let tokens = g.len();
    let dk = k.len() / tokens;
    let dv = v.len() / tokens;
    let mut start = 0;
    while start < tokens {
        let n = CHUNK.min(tokens - start);
        chunk::<S>(
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

/// The f32 vectors of one SIMD path, for [`matmul_add`]. The functions are unsafe because they need the path's
/// CPU features and read or write `LANES` values behind their pointers.
trait Vector {
    type V: Copy;
    const LANES: usize;
    unsafe fn zero() -> Self::V;
    unsafe fn splat(x: f32) -> Self::V;
    unsafe fn load(p: *const f32) -> Self::V;
    unsafe fn store(p: *mut f32, v: Self::V);
    /// `acc + a * b`.
    unsafe fn fma(a: Self::V, b: Self::V, acc: Self::V) -> Self::V;
    /// `acc + a * b` on single values, fused where the path's vectors are.
    fn madd(a: f32, b: f32, acc: f32) -> f32;
}

/// Portable code on arrays of 8 lanes, which the compiler vectorizes for the target's baseline; fused
/// multiply-adds on aarch64, where every CPU has them (elsewhere `mul_add` would be a library call).
struct Portable;

impl Vector for Portable {
    type V = [f32; 8];
    const LANES: usize = 8;
    #[inline(always)]
    unsafe fn zero() -> [f32; 8] {
        [0.0; 8]
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> [f32; 8] {
        [x; 8]
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> [f32; 8] {
        std::ptr::read_unaligned(p as *const [f32; 8])
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: [f32; 8]) {
        std::ptr::write_unaligned(p as *mut [f32; 8], v)
    }
    #[inline(always)]
    unsafe fn fma(a: [f32; 8], b: [f32; 8], acc: [f32; 8]) -> [f32; 8] {
        std::array::from_fn(|l| Self::madd(a[l], b[l], acc[l]))
    }
    #[inline(always)]
    fn madd(a: f32, b: f32, acc: f32) -> f32 {
        if cfg!(target_arch = "aarch64") {
            a.mul_add(b, acc)
        } else {
            acc + a * b
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::Vector;

    pub(super) struct Avx2;

    impl Vector for Avx2 {
        type V = __m256;
        const LANES: usize = 8;
        #[inline(always)]
        unsafe fn zero() -> __m256 {
            _mm256_setzero_ps()
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> __m256 {
            _mm256_set1_ps(x)
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m256 {
            _mm256_loadu_ps(p)
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m256) {
            _mm256_storeu_ps(p, v)
        }
        #[inline(always)]
        unsafe fn fma(a: __m256, b: __m256, acc: __m256) -> __m256 {
            _mm256_fmadd_ps(a, b, acc)
        }
        #[inline(always)]
        fn madd(a: f32, b: f32, acc: f32) -> f32 {
            a.mul_add(b, acc)
        }
    }

    pub(super) struct Avx512;

    impl Vector for Avx512 {
        type V = __m512;
        const LANES: usize = 16;
        #[inline(always)]
        unsafe fn zero() -> __m512 {
            _mm512_setzero_ps()
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> __m512 {
            _mm512_set1_ps(x)
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m512 {
            _mm512_loadu_ps(p)
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m512) {
            _mm512_storeu_ps(p, v)
        }
        #[inline(always)]
        unsafe fn fma(a: __m512, b: __m512, acc: __m512) -> __m512 {
            _mm512_fmadd_ps(a, b, acc)
        }
        #[inline(always)]
        fn madd(a: f32, b: f32, acc: f32) -> f32 {
            a.mul_add(b, acc)
        }
    }
}

/// `c[i][j] += sum_p a[i][p] * b[p][j]` for `i < m`, `j < n`, `p < k`, summed in order of `p`: `a` is `[m][k]`,
/// `b` `[k][n]`, `c` `[m][n]`, each row-major with rows `lda`, `ldb`, `ldc` values apart. Blocks of up to 4 rows
/// by 8 vectors in all (8 vectors of one row, 4 of two, 2 of three or four) are accumulated in registers over the
/// whole sum: enough independent sums to hide the latency of the multiply-adds.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn matmul_add<S: Vector>(
    c: &mut [f32],
    ldc: usize,
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
    (m, n, k): (usize, usize, usize),
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(c.len() >= (m - 1) * ldc + n && b.len() >= k.saturating_sub(1) * ldb + n);
    assert!(k == 0 || a.len() >= (m - 1) * lda + k);
    let mut i = 0;
    while i < m {
        let rows = (m - i).min(4);
        let (c, a) = (&mut c[i * ldc..], &a[i * lda..]);
        // SAFETY (each arm): the lengths were checked above; the path's features are those of the caller.
        unsafe {
            match rows {
                1 => matmul_rows::<S, 1, 8>(c, ldc, a, lda, b, ldb, n, k),
                2 => matmul_rows::<S, 2, 4>(c, ldc, a, lda, b, ldb, n, k),
                3 => matmul_rows::<S, 3, 2>(c, ldc, a, lda, b, ldb, n, k),
                _ => matmul_rows::<S, 4, 2>(c, ldc, a, lda, b, ldb, n, k),
            }
        }
        i += rows;
    }
}

/// [`matmul_add`] for the first `R` rows of `a` and `c`: blocks of `NB` vectors, then of one, then single
/// columns.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn matmul_rows<S: Vector, const R: usize, const NB: usize>(
    c: &mut [f32],
    ldc: usize,
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
    n: usize,
    k: usize,
) {
    let mut j = matmul_columns::<S, R, NB>(c, ldc, a, lda, b, ldb, 0, n, k);
    j = matmul_columns::<S, R, 1>(c, ldc, a, lda, b, ldb, j, n, k);
    for j in j..n {
        for r in 0..R {
            let mut acc = c[r * ldc + j];
            for p in 0..k {
                acc = S::madd(a[r * lda + p], b[p * ldb + j], acc);
            }
            c[r * ldc + j] = acc;
        }
    }
}

/// The blocks of `NB` vectors of columns from column `j` on that fit before `n`; returns the first column left.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn matmul_columns<S: Vector, const R: usize, const NB: usize>(
    c: &mut [f32],
    ldc: usize,
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
    mut j: usize,
    n: usize,
    k: usize,
) -> usize {
    let (cp, ap, bp) = (c.as_mut_ptr(), a.as_ptr(), b.as_ptr());
    while j + NB * S::LANES <= n {
        let mut acc = [[S::zero(); NB]; R];
        for (r, acc) in acc.iter_mut().enumerate() {
            for (v, acc) in acc.iter_mut().enumerate() {
                *acc = S::load(cp.add(r * ldc + j + v * S::LANES));
            }
        }
        for p in 0..k {
            let mut bv = [S::zero(); NB];
            for (v, bv) in bv.iter_mut().enumerate() {
                *bv = S::load(bp.add(p * ldb + j + v * S::LANES));
            }
            for (r, acc) in acc.iter_mut().enumerate() {
                let x = S::splat(*ap.add(r * lda + p));
                for (acc, bv) in acc.iter_mut().zip(&bv) {
                    *acc = S::fma(x, *bv, *acc);
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            for (v, acc) in acc.iter().enumerate() {
                S::store(cp.add(r * ldc + j + v * S::LANES), *acc);
            }
        }
        j += NB * S::LANES;
    }
    j
}

/// Log decays below which the chunked form takes the decay factor as zero.
const NEGLIGIBLE_LOG_DECAY: f32 = -30.0;

/// `exp(log_decay)`, or zero below [`NEGLIGIBLE_LOG_DECAY`]: a factor under `exp(-30)` (about 1e-13) changes no sum
/// it joins beyond f32 rounding, while its products would run down to subnormal numbers (strong decays reach
/// `exp(-1000)` within a chunk), on which x86 cores take a slow microcode assist per operation.
#[inline(always)]
fn decay(log_decay: f32) -> f32 {
    if log_decay < NEGLIGIBLE_LOG_DECAY {
        0.0
    } else {
        log_decay.exp()
    }
}

/// One chunk of `n <= CHUNK` tokens in the WY form. With `c_t` the cumulative log decay within the chunk:
///   A[t][s] = beta_t (k_t . k_s) exp(c_t - c_s) for s < t;  (I + A) U = beta*v;  (I + A) W = beta*k*exp(c)
///   V' = U - W S;  o_t = exp(c_t) q_t S + sum_{s<=t} (q_t . k_s) exp(c_t - c_s) V'_s
///   S <- exp(c_last) S + sum_s exp(c_last - c_s) k_s V'_s^T
/// Every step is a matrix product ([`matmul_add`]); the forward substitutions one row at a time.
#[inline(always)]
fn chunk<S: Vector>(q: &[f32], k: &[f32], v: &[f32], g: &[f32], beta: &[f32], state: &mut [f32], out: &mut [f32]) {
    let n = g.len();
    let dk = k.len() / n;
    let dv = v.len() / n;
    let mut cum = [0.0f32; CHUNK];
    let mut acc = 0.0;
    for t in 0..n {
        acc += g[t];
        cum[t] = acc;
    }
    // K transposed, `[dk][n]`, for the products with K^T.
    let mut kt = vec![0.0f32; dk * n];
    for t in 0..n {
        for i in 0..dk {
            kt[i * n + t] = k[t * dk + i];
        }
    }
    // -A (strictly lower triangular) from K K^T.
    let mut minus_a = vec![0.0f32; n * n];
    matmul_add::<S>(&mut minus_a, n, k, dk, &kt, n, (n, n, dk));
    for t in 0..n {
        for s in 0..n {
            let e = &mut minus_a[t * n + s];
            *e = if s < t {
                -(beta[t] * *e * decay(cum[t] - cum[s]))
            } else {
                0.0
            };
        }
    }
    // Forward substitution for U (n x dv) and -W (n x dk), row t from the rows before it.
    let mut u = vec![0.0f32; n * dv];
    let mut minus_w = vec![0.0f32; n * dk];
    for t in 0..n {
        for j in 0..dv {
            u[t * dv + j] = beta[t] * v[t * dv + j];
        }
        let e = beta[t] * decay(cum[t]);
        for i in 0..dk {
            minus_w[t * dk + i] = -(e * k[t * dk + i]);
        }
    }
    // Row t of W is exp(c_t) times a row of at most the keys' size (the substitution's factors exp(c_t - c_s)
    // carry the decays from row s to row t), so the rows whose log decay is below [`NEGLIGIBLE_LOG_DECAY`], the
    // last ones since the decays only grow, stay zero, as [`decay`] takes their own terms: substituted, their tiny
    // values would run down to subnormal numbers.
    let live = cum[..n].partition_point(|&c| c >= NEGLIGIBLE_LOG_DECAY);
    for t in 1..n {
        let coefs = &minus_a[t * n..t * n + t];
        let (done, row) = u.split_at_mut(t * dv);
        matmul_add::<S>(&mut row[..dv], dv, coefs, t, done, dv, (1, dv, t));
        if t < live {
            let (done, row) = minus_w.split_at_mut(t * dk);
            matmul_add::<S>(&mut row[..dk], dk, coefs, t, done, dk, (1, dk, t));
        }
    }
    // V' = U - W S, and the read of the incoming state by the decayed queries.
    let mut v_new = u;
    matmul_add::<S>(&mut v_new, dv, &minus_w, dk, state, dv, (live, dv, dk));
    let mut decayed_q = vec![0.0f32; n * dk];
    for t in 0..n {
        let e = decay(cum[t]);
        for i in 0..dk {
            decayed_q[t * dk + i] = q[t * dk + i] * e;
        }
    }
    out.fill(0.0);
    matmul_add::<S>(out, dv, &decayed_q, dk, state, dv, (n, dv, dk));
    // Intra-chunk attention, causal including the diagonal: P = (Q K^T) masked and decayed, then out += P V'.
    let mut p = vec![0.0f32; n * n];
    matmul_add::<S>(&mut p, n, q, dk, &kt, n, (n, n, dk));
    for t in 0..n {
        for s in 0..n {
            let e = &mut p[t * n + s];
            *e = if s <= t { *e * decay(cum[t] - cum[s]) } else { 0.0 };
        }
    }
    matmul_add::<S>(out, dv, &p, n, &v_new, dv, (n, dv, n));
    // The state after the chunk: decayed, plus (K decayed to the chunk's end)^T V'.
    let last = cum[n - 1];
    let chunk_decay = decay(last);
    state.iter_mut().for_each(|x| *x *= chunk_decay);
    for t in 0..n {
        let e = decay(last - cum[t]);
        for i in 0..dk {
            kt[i * n + t] *= e;
        }
    }
    matmul_add::<S>(state, dv, &kt, n, &v_new, dv, (dk, dv, n));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    #[test]
    fn chunked_form_equals_the_recurrence_on_every_path() {
        let mut rng = Rng::new(11);
        let (dk, dv) = (32, 48);
        // Weak decays, and strong ones as the model's (-exp(A_log) * softplus(..) reaches -16 per token).
        for (tokens, strength) in [
            (1, 0.3),
            (5, 0.3),
            (64, 0.3),
            (65, 0.3),
            (150, 0.3),
            (150, 16.0),
            (70, 3.0),
        ] {
            let mut q: Vec<f32> = (0..tokens * dk).map(|_| rng.normal()).collect();
            let mut k: Vec<f32> = (0..tokens * dk).map(|_| rng.normal()).collect();
            for t in 0..tokens {
                l2norm(&mut q[t * dk..(t + 1) * dk]);
                l2norm(&mut k[t * dk..(t + 1) * dk]);
            }
            let v: Vec<f32> = (0..tokens * dv).map(|_| rng.normal()).collect();
            let g: Vec<f32> = (0..tokens).map(|_| -strength * rng.uniform()).collect();
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
            for path in Path::available() {
                let mut s = initial.clone();
                let mut o = vec![f32::NAN; tokens * dv];
                chunked_on(path, &q, &k, &v, &g, &beta, &mut s, &mut o);
                let max_o = o.iter().zip(&o_ref).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
                let max_s = s.iter().zip(&s_ref).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
                assert!(
                    max_o < 1e-4 && max_s < 1e-4,
                    "{path:?} tokens {tokens} decay {strength}: out {max_o} state {max_s}"
                );
            }
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
        // In pieces longer and shorter than the state, and token by token with the decode step.
        let mut state = vec![0.0; (taps - 1) * channels];
        let mut out = vec![0.0; tokens * channels];
        for (start, end) in [(0, 4), (4, 5), (5, 7), (7, 9)] {
            let (x, out) = (
                &x[start * channels..end * channels],
                &mut out[start * channels..end * channels],
            );
            conv_sequence(x, &mut state, &w, taps, channels, out);
        }
        assert_eq!(out, out_all);
        assert_eq!(state, state_all);
        let mut state = vec![0.0; (taps - 1) * channels];
        for (x, out) in x.chunks_exact(channels).zip(out.chunks_exact_mut(channels)) {
            conv_step(x, &mut state, &w, taps, out);
        }
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
