//! `lily selftest`'s check of the prefill's Gated DeltaNet mixer (src/prefill_deltanet.rs, kernels/deltanet_prefill.cu)
//! against its CPU twin.

use half::{bf16, f16};
use lily_model::config::GROUP_SIZE;
use lily_model::cpu::deltanet::{chunked, conv_sequence, l2norm};
use lily_model::cpu::linalg::{rmsnorm_in_place, sigmoid, silu, softplus};
use lily_model::rng::Rng;
use lily_model::Config;
use rayon::prelude::*;

use super::gemm::CodesAgainstTwin;
use super::{download_f16, download_f32, normals, poison, rel_err, to_f16, widen_f16, Report};
use crate::driver::{Gpu, Result};
use crate::kernels::{Kernels, Q8x2};
use crate::launch::Launcher;
use crate::prefill_deltanet::{proj_dim, DeltaNetCut, DeltaNetScratch};
use crate::weights::{GpuGatedDeltaNet, GpuMatrix};

/// The mixer's own weights, on the CPU.
struct CpuWeights {
    conv1d: Vec<f32>,
    a_log: Vec<f32>,
    dt_bias: Vec<f32>,
    norm: Vec<f32>,
}

/// What one call leaves: the gated-norm output `[t][linear value dim]`, the state and the conv ring.
struct MixerResult {
    out: Vec<f32>,
    state: Vec<f32>,
    ring: Vec<f32>,
}

/// The CPU twin of one call, as the CPU prefill (cpu/model.rs) computes it: conv_sequence, the l2-norms and
/// gates, the chunked delta rule per value head, the gated RMSNorm; the ring as decode's steps would leave it.
fn cpu_mixer(c: &Config, w: &CpuWeights, proj: &[f32], start: usize, ring: &[f32], state: &[f32]) -> MixerResult {
    let (conv_dim, taps, key_dim) = (c.linear_conv_dim(), c.linear_conv_kernel_dim, c.linear_key_dim());
    let (nk, nv, dk, dv) = (
        c.linear_num_key_heads,
        c.linear_num_value_heads,
        c.linear_key_head_dim,
        c.linear_value_head_dim,
    );
    let p = proj_dim(c);
    let t = proj.len() / p;
    let x: Vec<f32> = proj
        .chunks_exact(p)
        .flat_map(|row| row[..conv_dim].iter().copied())
        .collect();
    // The conv state oldest first: positions start - taps + 1 .. start - 1 from their ring slots.
    let mut conv_state: Vec<f32> = (0..taps - 1)
        .flat_map(|j| ring[((start + 1 + j) % taps) * conv_dim..][..conv_dim].to_vec())
        .collect();
    let mut conv_out = vec![0.0; t * conv_dim];
    conv_sequence(&x, &mut conv_state, &w.conv1d, taps, conv_dim, &mut conv_out);
    let q_scale = 1.0 / (dk as f32).sqrt();
    for row in conv_out.chunks_exact_mut(conv_dim) {
        for head in row[..2 * key_dim].chunks_exact_mut(dk) {
            l2norm(head);
        }
        row[..key_dim].iter_mut().for_each(|v| *v *= q_scale);
    }
    let mut state = state.to_vec();
    let head_outputs: Vec<Vec<f32>> = state
        .par_chunks_mut(dk * dv)
        .enumerate()
        .map(|(head, s)| {
            let kh = head / (nv / nk);
            let gather = |offset: usize, n: usize| -> Vec<f32> {
                (0..t)
                    .flat_map(|tok| conv_out[tok * conv_dim + offset..][..n].to_vec())
                    .collect()
            };
            let (q, k, v) = (
                gather(kh * dk, dk),
                gather(key_dim + kh * dk, dk),
                gather(2 * key_dim + head * dv, dv),
            );
            let gates = |tok: usize| &proj[tok * p + conv_dim + nv * dv..][..2 * nv];
            let beta: Vec<f32> = (0..t).map(|tok| sigmoid(gates(tok)[head])).collect();
            let g: Vec<f32> = (0..t)
                .map(|tok| -w.a_log[head].exp() * softplus(gates(tok)[nv + head] + w.dt_bias[head]))
                .collect();
            let mut out = vec![0.0; t * dv];
            chunked(&q, &k, &v, &g, &beta, s, &mut out);
            out
        })
        .collect();
    let mut out = vec![0.0; t * nv * dv];
    for (head, o) in head_outputs.iter().enumerate() {
        for tok in 0..t {
            out[tok * nv * dv + head * dv..][..dv].copy_from_slice(&o[tok * dv..][..dv]);
        }
    }
    rmsnorm_in_place(&mut out, &w.norm, c.rms_norm_eps);
    for (tok, row) in out.chunks_exact_mut(nv * dv).enumerate() {
        for (o, z) in row.iter_mut().zip(&proj[tok * p + conv_dim..][..nv * dv]) {
            *o *= silu(*z);
        }
    }
    let mut ring = ring.to_vec();
    for tok in 0..t {
        ring[((start + tok) % taps) * conv_dim..][..conv_dim].copy_from_slice(&proj[tok * p..][..conv_dim]);
    }
    MixerResult { out, state, ring }
}

/// Checks the prefill mixer against its CPU twin (f32) on random weights and inputs: calls of 1, 37, 64, 200 and
/// 700 tokens from position 0 (zeroed ring and state) and from a random position that is not a multiple of 64
/// (random ring, state ~0.05), then 100 + 90 tokens in two calls against 190 in one. Then times a 4096-token call.
///
/// Tolerances: the output is bf16 (relative rounding up to 2^-8 = 3.9e-3 of a value) and comes from tf32 products
/// (operands rounded to 2^-11 relative): 1e-2. The state (updated in f32 by tf32 products whose errors partly
/// accumulate over the chunks, stored as f16: another 2^-11 relative): 5e-3. The ring holds copies: exact.
pub(crate) fn check(gpu: &Gpu, kernels: &Kernels, config: &Config, seed: u64, report: &mut Report) -> Result<()> {
    const OUT_TOL: f64 = 1e-2;
    const STATE_TOL: f64 = 5e-3;
    let c = config;
    let (conv_dim, taps, nv, dk, dv) = (
        c.linear_conv_dim(),
        c.linear_conv_kernel_dim,
        c.linear_num_value_heads,
        c.linear_key_head_dim,
        c.linear_value_head_dim,
    );
    let (p, value_dim) = (proj_dim(c), c.linear_value_dim());
    let mut rng = Rng::new(seed ^ 0x6764_6e5f_7072_6566);
    // Decays in a realistic range, exp(a_log) in 0.37 .. 7.4 and softplus(a + dt_bias) mostly 0.003 .. 0.3, so
    // the state carries over many chunks.
    let w = CpuWeights {
        conv1d: normals(&mut rng, conv_dim * taps, 0.5),
        a_log: (0..nv).map(|_| -1.0 + 3.0 * rng.uniform()).collect(),
        dt_bias: (0..nv).map(|_| -6.0 + 4.0 * rng.uniform()).collect(),
        norm: (0..dv).map(|_| 1.0 + 0.1 * rng.normal()).collect(),
    };
    // Only the mixer's own weights are read; the projections are not part of this check.
    let unused = || -> Result<GpuMatrix> { GpuMatrix::alloc(gpu, 0, 0, 4) };
    let weights = GpuGatedDeltaNet {
        in_proj: unused()?,
        conv1d: gpu.upload_new(&w.conv1d)?,
        a_log: gpu.upload_new(&w.a_log)?,
        dt_bias: gpu.upload_new(&w.dt_bias)?,
        norm: gpu.upload_new(&w.norm)?,
        out_proj: unused()?,
    };
    let mut launcher = Launcher::new(gpu, kernels);
    let max_tokens = 700;
    let scratch = DeltaNetScratch::new(gpu, c, max_tokens)?;
    let proj_buf = gpu.alloc(max_tokens * p)?;
    let ring_buf = gpu.alloc(taps * conv_dim)?;
    let state_buf = gpu.alloc(nv * dk * dv)?;
    let out_buf = gpu.alloc::<bf16>(max_tokens * value_dim)?;
    // The output rows' Q8x2 codes, as out_proj's integer small tiling reads them.
    let codes_buf = gpu.alloc::<u32>(max_tokens * value_dim / 2)?;
    let pairs_buf = gpu.alloc::<f32>(max_tokens * value_dim / GROUP_SIZE * 2)?;
    let codes = Q8x2 {
        codes: codes_buf.ptr(),
        pairs: pairs_buf.ptr(),
    };
    let cut_ring_bufs = [gpu.alloc(taps * conv_dim)?, gpu.alloc(taps * conv_dim)?];
    let cut_state_bufs = [gpu.alloc::<f16>(nv * dk * dv)?, gpu.alloc::<f16>(nv * dk * dv)?];
    // Uploads the inputs, runs `calls` (token counts) one after another, the first with snapshot cuts after each of
    // `cuts` tokens (at most two), returns what the GPU left: the call's result and each cut's (state and ring; no
    // output).
    let mut run_gpu = |proj: &[f32],
                       start: usize,
                       ring: &[f32],
                       state: &[f32],
                       calls: &[usize],
                       cuts: &[usize]|
     -> Result<(MixerResult, Vec<MixerResult>)> {
        let t: usize = calls.iter().sum();
        gpu.upload(proj_buf.ptr(), proj)?;
        gpu.upload(ring_buf.ptr(), ring)?;
        gpu.upload(state_buf.ptr(), &to_f16(state))?;
        gpu.memset_u32(out_buf.ptr(), 0x7fc0_7fc0, out_buf.bytes() / 4)?;
        gpu.memset_u32(codes_buf.ptr(), 0x5a5a_5a5a, codes_buf.bytes() / 4)?;
        poison(gpu, &pairs_buf)?;
        let s = &scratch;
        for buf in [
            &s.q,
            &s.k,
            &s.v_o,
            &s.decay,
            &s.beta,
            &s.inverse,
            &s.attn,
            &cut_ring_bufs[0],
            &cut_ring_bufs[1],
        ] {
            poison(gpu, buf)?;
        }
        for buf in &cut_state_bufs {
            poison(gpu, buf)?;
        }
        let mut done = 0;
        for (i, &n) in calls.iter().enumerate() {
            let cuts: Vec<DeltaNetCut> = match i {
                0 => cuts
                    .iter()
                    .enumerate()
                    .map(|(j, &tokens)| DeltaNetCut {
                        tokens,
                        ring: cut_ring_bufs[j].ptr(),
                        state: cut_state_bufs[j].ptr(),
                    })
                    .collect(),
                _ => Vec::new(),
            };
            scratch.run(
                &mut launcher,
                c,
                n,
                start + done,
                proj_buf.at(done * p),
                ring_buf.ptr(),
                state_buf.ptr(),
                &weights,
                out_buf.at(done * value_dim),
                codes.from_row(done, value_dim),
                &cuts,
            )?;
            done += n;
        }
        gpu.sync()?;
        let mut out = vec![bf16::ZERO; t * value_dim];
        gpu.download(out_buf.ptr(), &mut out)?;
        let at_cut = (0..cuts.len())
            .map(|j| {
                Ok(MixerResult {
                    out: Vec::new(),
                    state: download_f16(gpu, &cut_state_bufs[j], nv * dk * dv)?,
                    ring: download_f32(gpu, &cut_ring_bufs[j], taps * conv_dim)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((
            MixerResult {
                out: out.iter().map(|v| v.to_f32()).collect(),
                state: download_f16(gpu, &state_buf, nv * dk * dv)?,
                ring: download_f32(gpu, &ring_buf, taps * conv_dim)?,
            },
            at_cut,
        ))
    };

    for new_sequence in [true, false] {
        let mut worst = [(0.0f64, 0usize); 3];
        let mut codes: Option<CodesAgainstTwin> = None;
        // Up to deltanet_short_max_tokens (32) the recurrence token by token, past it the chunked form.
        for t in [1, 16, 32, 37, 64, 200, 700] {
            let start = if new_sequence {
                0
            } else {
                64 * (rng.next_u64() % 40) as usize + 1 + (rng.next_u64() % 63) as usize
            };
            let proj = normals(&mut rng, t * p, 1.0);
            let (ring, state) = if new_sequence {
                (vec![0.0; taps * conv_dim], vec![0.0; nv * dk * dv])
            } else {
                (
                    normals(&mut rng, taps * conv_dim, 1.0),
                    widen_f16(&to_f16(&normals(&mut rng, nv * dk * dv, 0.05))),
                )
            };
            let (got, _) = run_gpu(&proj, start, &ring, &state, &[t], &[])?;
            // The output rows' codes, as out_proj's integer small tiling reads them.
            let these = CodesAgainstTwin::measure(gpu, &codes_buf, &pairs_buf, &got.out)?;
            codes = Some(match codes {
                Some(before) => before.and(these),
                None => these,
            });
            let want = cpu_mixer(c, &w, &proj, start, &ring, &state);
            let errors = [
                rel_err(&got.out, &want.out),
                rel_err(&got.state, &want.state),
                rel_err(&got.ring, &want.ring),
            ];
            for (slot, e) in worst.iter_mut().zip(errors) {
                if e >= slot.0 {
                    *slot = (e, t);
                }
            }
        }
        let from = if new_sequence {
            "start 0"
        } else {
            "start not a multiple of 64"
        };
        report.check(
            &format!("deltanet_prefill ({from}): output (worst t = {})", worst[0].1),
            worst[0].0,
            OUT_TOL,
        );
        report.check(
            &format!("deltanet_prefill ({from}): recurrent state (worst t = {})", worst[1].1),
            worst[1].0,
            STATE_TOL,
        );
        report.check(&format!("deltanet_prefill ({from}): conv ring"), worst[2].0, 0.0);
        if let Some(codes) = codes {
            codes.report(report, &format!("deltanet_prefill ({from}): output rows"));
        }
    }

    // Continuation: 100 + 90 tokens in two calls against one CPU call of 190.
    {
        let start = 64 * (rng.next_u64() % 40) as usize + 1 + (rng.next_u64() % 63) as usize;
        let proj = normals(&mut rng, 190 * p, 1.0);
        let ring = normals(&mut rng, taps * conv_dim, 1.0);
        let state = widen_f16(&to_f16(&normals(&mut rng, nv * dk * dv, 0.05)));
        let (got, _) = run_gpu(&proj, start, &ring, &state, &[100, 90], &[])?;
        CodesAgainstTwin::measure(gpu, &codes_buf, &pairs_buf, &got.out)?
            .report(report, "deltanet_prefill 100 + 90 tokens == 190: output rows");
        let want = cpu_mixer(c, &w, &proj, start, &ring, &state);
        report.check(
            "deltanet_prefill 100 + 90 tokens == 190: output",
            rel_err(&got.out, &want.out),
            OUT_TOL,
        );
        report.check(
            "deltanet_prefill 100 + 90 tokens == 190: recurrent state",
            rel_err(&got.state, &want.state),
            STATE_TOL,
        );
        report.check(
            "deltanet_prefill 100 + 90 tokens == 190: conv ring",
            rel_err(&got.ring, &want.ring),
            0.0,
        );
    }

    // Snapshot cuts inside a call: the state and ring after the first `cut` tokens, written in the pass, against
    // the CPU twin of those tokens alone (mid-chunk, at a chunk's end, one token before the call's end, from
    // position 0 and from elsewhere; one cut or two in different chunks), and the call's own result as without
    // the cuts.
    {
        let mut worst = [(0.0f64, 0usize, 0usize); 5];
        for (t, cuts, new_sequence) in [
            (3, &[1][..], true),
            (20, &[7], false),
            (32, &[31], true),
            (100, &[37], false),
            (200, &[64], false),
            (300, &[150], true),
            (130, &[129], false),
            (420, &[158, 417], false),
            (200, &[64, 65], true),
            (130, &[1, 129], false),
        ] {
            let start = if new_sequence {
                0
            } else {
                64 * (rng.next_u64() % 40) as usize + 1 + (rng.next_u64() % 63) as usize
            };
            let proj = normals(&mut rng, t * p, 1.0);
            let (ring, state) = if new_sequence {
                (vec![0.0; taps * conv_dim], vec![0.0; nv * dk * dv])
            } else {
                (
                    normals(&mut rng, taps * conv_dim, 1.0),
                    widen_f16(&to_f16(&normals(&mut rng, nv * dk * dv, 0.05))),
                )
            };
            let (got, at_cuts) = run_gpu(&proj, start, &ring, &state, &[t], cuts)?;
            let want = cpu_mixer(c, &w, &proj, start, &ring, &state);
            for (&cut, at_cut) in cuts.iter().zip(&at_cuts) {
                let want_cut = cpu_mixer(c, &w, &proj[..cut * p], start, &ring, &state);
                let errors = [
                    rel_err(&at_cut.state, &want_cut.state),
                    rel_err(&at_cut.ring, &want_cut.ring),
                    rel_err(&got.out, &want.out),
                    rel_err(&got.state, &want.state),
                    rel_err(&got.ring, &want.ring),
                ];
                for (slot, e) in worst.iter_mut().zip(errors) {
                    if e >= slot.0 {
                        *slot = (e, t, cut);
                    }
                }
            }
        }
        let what = [
            "state at the cut",
            "conv ring at the cut",
            "output",
            "recurrent state",
            "conv ring",
        ];
        let tolerances = [STATE_TOL, 0.0, OUT_TOL, STATE_TOL, 0.0];
        for ((what, tol), (e, t, cut)) in what.iter().zip(tolerances).zip(worst) {
            report.check(
                &format!("deltanet_prefill with cuts inside: {what} (worst t = {t}, cut {cut})"),
                e,
                tol,
            );
        }
    }

    // Speed: one 4096-token call, after a warm-up call (no step depends on the values, so zeros will do).
    {
        let t = 4096;
        let scratch = DeltaNetScratch::new(gpu, c, t)?;
        let proj = gpu.alloc_zeroed(t * p)?;
        let out = gpu.alloc(t * value_dim)?;
        let mut call = || {
            scratch.run(
                &mut launcher,
                c,
                t,
                0,
                proj.ptr(),
                ring_buf.ptr(),
                state_buf.ptr(),
                &weights,
                out.ptr(),
                Q8x2::NONE,
                &[],
            )
        };
        call()?;
        gpu.sync()?;
        let (begin, end) = (gpu.event()?, gpu.event()?);
        gpu.record(&begin)?;
        call()?;
        gpu.record(&end)?;
        gpu.sync()?;
        println!("     deltanet_prefill: {t} tokens in {:.3} ms", begin.elapsed_ms(&end)?);
    }
    Ok(())
}
