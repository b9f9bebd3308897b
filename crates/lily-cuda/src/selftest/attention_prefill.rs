//! `lily selftest`'s check of the prefill's attention mixer (src/prefill_attention.rs, kernels/attention_prefill.cu)
//! against its CPU twin.

use half::bf16;
use lily_model::backend::Backend;
use lily_model::cpu::attention::{attend, rope};
use lily_model::cpu::linalg::{rmsnorm, sigmoid};
use lily_model::rng::Rng;
use lily_model::weights::Weights;
use lily_model::Config;

use super::{normals, rel_err, shuffled, Report};
use crate::driver::{Gpu, GpuError, Result};
use crate::kernels::Kernels;
use crate::launch::Launcher;
use crate::model::{CudaBackend, CudaModel};
use crate::pages::{pages_for, KV_PAGE};
use crate::prefill_attention::{key_split, values8, values8_per_head, AttentionScratch, Int8Scores};
use crate::weights::{GpuAttention, GpuMatrix, Source};

fn bf16_to_f32(v: &[bf16]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

/// Selftest: prep and attention against the CPU twin (rmsnorm, RoPE, `attend` over the bf16 K/V the GPU reads,
/// sigmoid gate; for `attn_prefill_i8`, over the twin of its 8-bit codes as well), for prompts from the start (t = 1, 50, 300: one query tile, several, a ragged last tile) and after
/// a random odd-length prefix of random keys and values (t = 130 and t = 1: the key range split into chunks). The
/// keys and values live in pools of pages in a shuffled order (more pages than the sequence takes, the others
/// NaN), reached through the sequence's page-table row.
pub(crate) fn check(gpu: &Gpu, kernels: &Kernels, config: &Config, seed: u64, report: &mut Report) -> Result<()> {
    let c = config;
    let mut rng = Rng::new(seed ^ 0xa77e);
    let (heads, kv_heads, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
    let (q_dim, kv_dim) = (c.q_dim(), c.kv_dim());
    let row = 2 * q_dim + 2 * kv_dim;
    let nan = bf16::NAN;
    let prefix = 1001 + 2 * (rng.next_u64() % 500) as usize;
    let cases = [(1, 0), (50, 0), (300, 0), (130, prefix), (1, prefix)];
    let max_tokens = cases.iter().map(|&(t, _)| t).max().unwrap_or(1);
    let max_len = cases.iter().map(|&(t, start)| t + start).max().unwrap_or(1);

    let scratch = AttentionScratch::new(gpu, kernels, c, max_tokens, max_len)?.with_score_codes(gpu, kernels, c)?;
    let q_norm: Vec<f32> = (0..hd).map(|_| 1.0 + 0.2 * rng.normal()).collect();
    let k_norm: Vec<f32> = (0..hd).map(|_| 1.0 + 0.2 * rng.normal()).collect();
    let inv_freq = c.rope_inv_freq();
    // `run` reads only the norms of the layer's weights.
    let no_matrix = || -> Result<GpuMatrix> { GpuMatrix::alloc(gpu, 0, 0, 4) };
    let weights = GpuAttention {
        qkv: no_matrix()?,
        q_norm: gpu.alloc(hd)?,
        k_norm: gpu.alloc(hd)?,
        o_proj: no_matrix()?,
    };
    gpu.upload(weights.q_norm.ptr(), &q_norm)?;
    gpu.upload(weights.k_norm.ptr(), &k_norm)?;
    let inv_freq_buf = gpu.upload_new(&inv_freq)?;
    let proj_buf = gpu.alloc(max_tokens * row)?;
    let pool_pages = pages_for(max_len) + 3;
    let page_len = KV_PAGE * kv_dim;
    let k_pool = gpu.alloc(pool_pages * page_len)?;
    let v_pool = gpu.alloc(pool_pages * page_len)?;
    let table: Vec<i32> = shuffled(&mut rng, pool_pages)[..pages_for(max_len)].to_vec();
    let table_buf = gpu.upload_new(&table)?;
    // Position p of the sequence at row p % KV_PAGE of page table[p / KV_PAGE].
    let at = |p: usize| (table[p / KV_PAGE] as usize * KV_PAGE + p % KV_PAGE) * kv_dim;
    let scatter = |cache: &[bf16]| -> Vec<bf16> {
        let mut pool = vec![nan; pool_pages * page_len];
        for (p, row) in cache.chunks_exact(kv_dim).enumerate() {
            pool[at(p)..at(p) + kv_dim].copy_from_slice(row);
        }
        pool
    };
    let gather = |pool: &[bf16], len: usize| -> Vec<bf16> {
        (0..len).flat_map(|p| pool[at(p)..at(p) + kv_dim].to_vec()).collect()
    };
    let out_buf = gpu.alloc(max_tokens * q_dim)?;
    let mut launcher = Launcher::new(gpu, kernels);

    // Every case through `attn_prefill_wgmma` and `attn_prefill_i8` where this build has them, and through
    // `attn_prefill` (other GPUs').
    let built = |name| kernels.constant(name) == 1;
    let kernel_cases = [Kernel::Wgmma, Kernel::Int8, Kernel::Portable]
        .into_iter()
        .filter(|k| match k {
            Kernel::Wgmma => built("attn_prefill_wgmma_built"),
            Kernel::Int8 => built("attn_prefill_i8_built"),
            Kernel::Portable => true,
        })
        .flat_map(|kernel| cases.map(|case| (kernel, case)));
    for (kernel, (t, start)) in kernel_cases {
        scratch.portable.set(kernel == Kernel::Portable);
        scratch.int8_scores.set(match kernel {
            Kernel::Int8 => Int8Scores::Always,
            _ => Int8Scores::Never,
        });
        let len = start + t;
        let proj = normals(&mut rng, t * row, 1.0);
        // Random keys and values before `start`, NaN where this call must write.
        let cache_in = |rng: &mut Rng| -> Vec<bf16> {
            let mut v: Vec<bf16> = (0..start * kv_dim).map(|_| bf16::from_f32(rng.normal())).collect();
            v.resize(len * kv_dim, nan);
            v
        };
        let (k_in, v_in) = (cache_in(&mut rng), cache_in(&mut rng));
        gpu.upload(proj_buf.ptr(), &proj)?;
        gpu.upload(k_pool.ptr(), &scatter(&k_in))?;
        gpu.upload(v_pool.ptr(), &scatter(&v_in))?;
        gpu.upload(out_buf.ptr(), &vec![nan; t * q_dim])?;
        gpu.upload(scratch.q.ptr(), &vec![nan; t * q_dim])?;
        scratch.run(
            &mut launcher,
            c,
            t,
            start,
            proj_buf.ptr(),
            &weights,
            inv_freq_buf.ptr(),
            k_pool.ptr(),
            v_pool.ptr(),
            table_buf.ptr(),
            out_buf.ptr(),
        )?;
        gpu.sync()?;
        let mut q_gpu = vec![bf16::ZERO; t * q_dim];
        let mut k_gpu = vec![bf16::ZERO; pool_pages * page_len];
        let mut v_gpu = vec![bf16::ZERO; pool_pages * page_len];
        let mut out_gpu = vec![bf16::ZERO; t * q_dim];
        gpu.download(scratch.q.ptr(), &mut q_gpu)?;
        gpu.download(k_pool.ptr(), &mut k_gpu)?;
        gpu.download(v_pool.ptr(), &mut v_gpu)?;
        gpu.download(out_buf.ptr(), &mut out_gpu)?;
        let (k_gpu, v_gpu) = (bf16_to_f32(&gather(&k_gpu, len)), bf16_to_f32(&gather(&v_gpu, len)));

        // CPU twin of the prep: queries (unscaled: `attend` scales), and the whole cache as it should be after.
        let mut q = vec![0.0f32; t * q_dim];
        let mut k_ref = bf16_to_f32(&k_in[..start * kv_dim]);
        let mut v_ref = bf16_to_f32(&v_in[..start * kv_dim]);
        for i in 0..t {
            let src = &proj[i * row..(i + 1) * row];
            for h in 0..heads {
                let qh = &mut q[(i * heads + h) * hd..(i * heads + h + 1) * hd];
                rmsnorm(&src[h * 2 * hd..h * 2 * hd + hd], &q_norm, c.rms_norm_eps, qh);
                rope(qh, start + i, &inv_freq);
            }
            for h in 0..kv_heads {
                let mut k = vec![0.0; hd];
                rmsnorm(
                    &src[2 * q_dim + h * hd..2 * q_dim + (h + 1) * hd],
                    &k_norm,
                    c.rms_norm_eps,
                    &mut k,
                );
                rope(&mut k, start + i, &inv_freq);
                k_ref.extend(k);
            }
            v_ref.extend_from_slice(&src[2 * q_dim + kv_dim..]);
        }
        let q_scaled: Vec<f32> = q.iter().map(|v| v / (hd as f32).sqrt()).collect();
        // Each value is one bf16 rounding of the f32 result (relative error <= 2^-8), so max error / max value
        // <= 3.9e-3 plus f32 noise; the prefix rows must come back as they were.
        let prep_err = rel_err(&bf16_to_f32(&q_gpu), &q_scaled)
            .max(rel_err(&k_gpu, &k_ref))
            .max(rel_err(&v_gpu, &v_ref));
        report.check(
            &format!("attn_prefill_prep t={t} start={start}: q, k and v into shuffled pages (bf16)"),
            prep_err,
            5e-3,
        );

        // CPU twin of the attention over the K/V the GPU reads (its bf16 cache), with the gate.
        let gated = |q: &[f32], k: &[f32], v: &[f32]| -> Vec<f32> {
            let mut out = vec![0.0f32; t * q_dim];
            attend(q, k, v, start, heads, kv_heads, hd, &mut out);
            for i in 0..t {
                for h in 0..heads {
                    let gate = &proj[i * row + h * 2 * hd + hd..i * row + (h + 1) * 2 * hd];
                    for (o, g) in out[(i * heads + h) * hd..(i * heads + h + 1) * hd].iter_mut().zip(gate) {
                        *o *= sigmoid(*g);
                    }
                }
            }
            out
        };
        let expected = gated(&q, &k_gpu, &v_gpu);
        let split = key_split(t, start, kv_heads, gpu.sm_count);
        let name = format!(
            "{} t={t} start={start} ({} key chunk(s)): gated output",
            kernel.name(),
            split.splits
        );
        let got = bf16_to_f32(&out_gpu);
        if kernel == Kernel::Int8 {
            // The twin of the codes: the GPU's bf16 queries and its cache's keys less the mean of the keys it
            // samples over the context, each row as 8-bit codes times its scale (unscaled for `attend`, which scales the queries).
            let (q_codes, k_codes) = score_codes(&bf16_to_f32(&q_gpu), &k_gpu, len, kv_heads, hd);
            let q_codes: Vec<f32> = q_codes.iter().map(|v| v * (hd as f32).sqrt()).collect();
            // Against the twin of the codes, the bf16 P and output roundings remain (as below); against the exact
            // scores, the codes' error too: a score moves by ~1e-2 at these unit-variance rows, so the output
            // moves by ~1e-2 of its largest value where few keys weigh.
            // With the values in e4m3 (ATTN_I8_V8) the twin takes them as the kernel does; P's e4m3 rounding (at
            // most 2^-4 of each probability) remains, which where one key weighs most moves the output by up to
            // that share of its largest value.
            let (v_twin, tolerance, exact_tolerance) = match values8(kernels) {
                true => (
                    value_codes(&v_gpu, len, kv_heads, hd, values8_per_head(kernels)),
                    6e-2,
                    1e-1,
                ),
                false => (v_gpu.clone(), 1e-2, 5e-2),
            };
            report.check(&name, rel_err(&got, &gated(&q_codes, &k_codes, &v_twin)), tolerance);
            report.check(
                &format!("{} t={t} start={start}: against exact scores", kernel.name()),
                rel_err(&got, &expected),
                exact_tolerance,
            );
        } else {
            // The GPU rounds q and P to bf16 (each <= 2^-8 relative; over many keys the P errors average out) and
            // the output to bf16 (<= 2^-8 of each value): a few 1e-3 of the largest output; a wrong key or mask is
            // O(1).
            report.check(&name, rel_err(&got, &expected), 1e-2);
        }
    }
    Ok(())
}

/// Which attention kernel a case runs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kernel {
    Wgmma,
    Int8,
    Portable,
}

impl Kernel {
    fn name(self) -> &'static str {
        match self {
            Kernel::Wgmma => "attn_prefill_wgmma",
            Kernel::Int8 => "attn_prefill_i8",
            Kernel::Portable => "attn_prefill",
        }
    }
}

/// A row as `attn_prefill_codes` codes it, decoded: round(x / scale) * scale, scale = max |x| / 127.
fn coded(row: &[f32]) -> Vec<f32> {
    let amax = row.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    let (inv, scale) = match amax > 0.0 {
        true => (127.0 / amax, amax / 127.0),
        false => (0.0, 0.0),
    };
    row.iter()
        .map(|x| (x * inv).round_ties_even().clamp(-127.0, 127.0) * scale)
        .collect()
}

/// The twin of `attn_prefill_v_codes`: each (KV head, block of 64 positions) of the values as e4m3 with the block's
/// largest magnitude at 448, or with `per_head` (ATTN_I8_V8_ROW) the head's largest.
fn value_codes(v: &[f32], len: usize, kv_heads: usize, hd: usize, per_head: bool) -> Vec<f32> {
    let kv_dim = kv_heads * hd;
    let mut out = v[..len * kv_dim].to_vec();
    for h in 0..kv_heads {
        let at = |p: usize| p * kv_dim + h * hd..p * kv_dim + (h + 1) * hd;
        let largest =
            |rows: std::ops::Range<usize>| rows.flat_map(|p| v[at(p)].to_vec()).fold(0.0f32, |m, x| m.max(x.abs()));
        let head_amax = largest(0..len);
        for block in (0..len).step_by(64) {
            let rows = block..(block + 64).min(len);
            let amax = match per_head {
                true => head_amax,
                false => largest(rows.clone()),
            };
            let scale = (amax / 448.0).max(1e-20);
            for p in rows {
                out[at(p)]
                    .iter_mut()
                    .for_each(|x| *x = lily_model::cpu::numerics::e4m3(*x / scale) * scale);
            }
        }
    }
    out
}

/// The CPU twin of `attn_prefill_key_mean` and `attn_prefill_codes`: the queries `q` (`[t][heads][hd]`) and the
/// keys `k` (`[position][kv heads][hd]`, `len` of them) less the mean of the keys at positions j len / n (j < n =
/// min(len, 256)), every row coded and decoded.
fn score_codes(q: &[f32], k: &[f32], len: usize, kv_heads: usize, hd: usize) -> (Vec<f32>, Vec<f32>) {
    let kv_dim = kv_heads * hd;
    let n = len.min(256);
    let mut mean = vec![0.0f32; kv_dim];
    for j in 0..n {
        let p = j * len / n;
        mean.iter_mut()
            .zip(&k[p * kv_dim..(p + 1) * kv_dim])
            .for_each(|(m, x)| *m += x);
    }
    mean.iter_mut().for_each(|m| *m /= n as f32);
    let q_codes = q.chunks_exact(hd).flat_map(coded).collect();
    let k_codes = k
        .chunks_exact(hd)
        .enumerate()
        .flat_map(|(i, row)| {
            let m = &mean[(i % kv_heads) * hd..][..hd];
            coded(&row.iter().zip(m).map(|(x, m)| x - m).collect::<Vec<f32>>())
        })
        .collect();
    (q_codes, k_codes)
}

/// The int8 scores where the kernel file's default gate takes them, end to end on `weights` (the trained default
/// model): a random prompt of 12,288 tokens, prefilled in one call and in calls of 4,096 (the second and third reach
/// 8,192 keys, so the gate takes them), then four decode steps, against the same with bf16 scores in every call
/// (within the default model's end-to-end tolerance, 6e-2).
/// The selftest's other prompts all stay below the gate. Skipped where the build's default is another.
pub(crate) fn check_default_gate(weights: &Weights, seed: u64, report: &mut Report) -> Result<()> {
    const PROMPT: usize = 12_288;
    let config = weights.config.clone();
    let model = CudaModel::single(
        Gpu::open()?,
        config.clone(),
        &Source::Cpu(weights),
        PROMPT + 64,
        &|_, _| {},
    )?;
    let mut gpu = CudaBackend::new(model);
    let default = gpu.model.prefill.attn.int8_scores.get();
    if default != Int8Scores::Long || !gpu.model.prefill.attn.has_score_codes() {
        println!("     this build's int8 scores are not the default gate ({default:?}): skipped");
        return Ok(());
    }
    let fe = |e: lily_model::ForwardError| GpuError::Other(e.to_string());
    let mut rng = Rng::new(seed ^ 0x1288);
    let vocab = config.vocab_size as u64;
    let prompt: Vec<u32> = (0..PROMPT).map(|_| (rng.next_u64() % vocab) as u32).collect();
    for chunk in [gpu.model.prefill_chunk, 4096] {
        gpu.model.prefill_chunk = chunk;
        // Attention calls the gate takes: each call's layers where the call has 4,096 tokens and reaches 8,192 keys.
        let calls = (0..PROMPT.div_ceil(chunk)).map(|i| (i * chunk, chunk.min(PROMPT - i * chunk)));
        let expected = calls.filter(|&(start, t)| t >= 4096 && start + t >= 8192).count() * config.num_full_layers();
        let mut runs = Vec::new();
        for scores in [Int8Scores::Never, Int8Scores::Long] {
            gpu.model.prefill.attn.int8_scores.set(scores);
            let before = gpu.model.prefill.attn.int8_calls.get();
            gpu.prefill(&prompt).map_err(fe)?;
            let mut logits = vec![gpu.logits().map_err(fe)?.to_vec()];
            for &token in &prompt[..4] {
                gpu.decode(token).map_err(fe)?;
                logits.push(gpu.logits().map_err(fe)?.to_vec());
            }
            runs.push((logits, gpu.model.prefill.attn.int8_calls.get() - before));
        }
        let reached = runs[0].1 == 0 && runs[1].1 == expected && expected > 0;
        report.check_eq(
            &format!("default gate, prompt of {PROMPT} in calls of {chunk}: int8 calls"),
            reached,
            &format!("{} attention calls on int8 scores ({expected} expected)", runs[1].1),
        );
        let worst = (runs[1].0.iter().zip(&runs[0].0))
            .map(|(int8, bf16)| rel_err(int8, bf16))
            .fold(0.0f64, f64::max);
        // The trained model's tolerance for two roundings of one prompt (as compare_prefill's): where a token's
        // top-8 routing is a near-tie, the two may choose different experts for it. The values in e4m3
        // (ATTN_I8_V8) round every probability and value to 2^-4 of itself, which moves this prompt's logits by
        // about the whole of that tolerance (bench/RESULTS.md): their build is held to 1e-1.
        let tolerance = match values8(&gpu.model.kernels) {
            true => 1e-1,
            false => 6e-2,
        };
        report.check(
            &format!("default gate, prompt of {PROMPT} in calls of {chunk}, 4 steps vs bf16 scores"),
            worst,
            tolerance,
        );
    }
    gpu.model.prefill.attn.int8_scores.set(default);
    Ok(())
}
