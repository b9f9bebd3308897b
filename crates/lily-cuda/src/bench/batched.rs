//! `lily bench --batch B,...`: the batched decode step of continuous batching. For each batch size and depth, B
//! slots are filled by a real prefill of `depth` random tokens each (at least one), then `-n` steps of all B rows
//! (greedy, sampled on the GPU) are timed `-r` times after one warm-up step (which captures the step's graph).
//! Reports the step time and the aggregate tokens per second, and with `--profile` the per-kernel GPU time of one
//! un-captured step. With `-p P,...` it times instead the prefill of B prompts of P random tokens each, one prompt a
//! call and joined into passes of up to the backend's prefill budget (as the server's engine joins them).

use std::time::Instant;

use lily_model::backend::{BatchBackend, Pick, PrefillPart, StepRow};
use lily_model::rng::Rng;
use lily_model::sampling::Sampler;

use super::mean_std;
use crate::batch::{enqueue_step, CudaBatchBackend};
use crate::driver::{GpuError, Result};
use crate::launch::Profile;

fn fe(e: lily_model::ForwardError) -> GpuError {
    GpuError::Other(e.to_string())
}

/// Times the batched step for each of `batches` rows at each of `depths`; prints one table row each.
pub fn run(
    backend: &mut CudaBatchBackend,
    batches: &[usize],
    depths: &[usize],
    generate: usize,
    repetitions: usize,
    profile: bool,
) -> Result<()> {
    let mut rng = Rng::new(0xba7c);
    let vocab = backend.config().vocab_size as u64;
    println!("| test | depth | rows | step ms | t/s (all rows) | t/s per row |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: |");
    for &depth in depths {
        for &rows in batches {
            if rows == 0 || rows > backend.max_step_rows() {
                return Err(GpuError::Other(format!(
                    "a batch of {rows}: the backend has {} slots",
                    backend.max_step_rows()
                )));
            }
            let prompt_len = depth.max(1);
            let needed = prompt_len + (repetitions + 1) * generate + 1;
            for slot in 0..rows {
                backend.release(slot);
                if !backend.reserve(slot, needed).map_err(fe)? {
                    return Err(GpuError::Other(format!(
                        "no KV pages for {rows} sequences of {needed} tokens"
                    )));
                }
                let prompt: Vec<u32> = (0..prompt_len).map(|_| (rng.next_u64() % vocab) as u32).collect();
                for piece in prompt.chunks(backend.max_prefill_tokens()) {
                    backend.prefill(slot, piece).map_err(fe)?;
                }
            }
            let mut samplers: Vec<Sampler> = (0..rows).map(|_| Sampler::new(Default::default())).collect();
            let mut tokens: Vec<u32> = (0..rows).map(|_| (rng.next_u64() % vocab) as u32).collect();
            let mut one_step = |backend: &mut CudaBatchBackend, tokens: &mut Vec<u32>| -> Result<()> {
                let step: Vec<StepRow> = (0..rows)
                    .map(|slot| StepRow {
                        slot,
                        token: tokens[slot],
                    })
                    .collect();
                backend.step(&step).map_err(fe)?;
                let mut picks: Vec<Pick> = samplers
                    .iter_mut()
                    .enumerate()
                    .map(|(row, sampler)| Pick {
                        row,
                        sampler,
                        allowed: None,
                    })
                    .collect();
                *tokens = backend.sample(&mut picks).map_err(fe)?;
                Ok(())
            };
            one_step(backend, &mut tokens)?;
            let mut samples = Vec::new();
            for _ in 0..repetitions {
                let start = Instant::now();
                for _ in 0..generate {
                    one_step(backend, &mut tokens)?;
                }
                samples.push(start.elapsed().as_secs_f64() / generate as f64);
            }
            let (step, std) = mean_std(&samples);
            println!(
                "| step | {depth} | {rows} | {:.2} ± {:.2} | {:.0} | {:.1} |",
                step * 1e3,
                std * 1e3,
                rows as f64 / step,
                1.0 / step
            );
            if profile {
                let mut p = Profile::default();
                let m = &backend.model;
                let l = &mut m.launcher(Some(&mut p));
                enqueue_step(
                    l,
                    &m.config,
                    &m.weights,
                    &m.state,
                    &m.slot,
                    &m.prefill,
                    backend.step_scratch(),
                    rows,
                )?;
                p.collect()?;
                let total: f64 = p.entries.iter().map(|e| e.1).sum();
                println!("     one un-captured step of {rows} rows: {total:.2} ms of kernels");
                print!("{}", p.report("     ", 24));
            }
            for slot in 0..rows {
                backend.release(slot);
            }
        }
    }
    Ok(())
}

/// Times the prefill of `rows` prompts of each of `prompts` tokens for each of `batches`, `repetitions` times after
/// a warm-up: one prompt a call (in chunks of `max_prefill_tokens`), then joined, whole prompts into passes of up
/// to `prefill_budget` tokens; prints one table row each.
pub fn run_prefill(
    backend: &mut CudaBatchBackend,
    batches: &[usize],
    prompts: &[usize],
    repetitions: usize,
) -> Result<()> {
    let mut rng = Rng::new(0x9f11);
    let vocab = backend.config().vocab_size as u64;
    let budget = backend.prefill_budget().min(backend.max_prefill_tokens());
    println!("| test | prompts | calls | ms | t/s |");
    println!("| --- | ---: | --- | ---: | ---: |");
    for &len in prompts {
        for &rows in batches {
            if rows == 0 || rows > backend.max_seqs() || len == 0 {
                return Err(GpuError::Other(format!(
                    "{rows} prompts of {len} tokens: the backend has {} slots",
                    backend.max_seqs()
                )));
            }
            let texts: Vec<Vec<u32>> = (0..rows)
                .map(|_| (0..len).map(|_| (rng.next_u64() % vocab) as u32).collect())
                .collect();
            for joined in [false, true] {
                let mut samples = Vec::new();
                let mut calls = 0;
                for rep in 0..=repetitions {
                    for slot in 0..rows {
                        backend.release(slot);
                        if !backend.reserve(slot, len + 1).map_err(fe)? {
                            return Err(GpuError::Other(format!(
                                "no KV pages for {rows} prompts of {len} tokens"
                            )));
                        }
                    }
                    let start = Instant::now();
                    calls = prefill_all(backend, &texts, joined, budget)?;
                    if rep > 0 {
                        samples.push(start.elapsed().as_secs_f64());
                    }
                }
                let (time, std) = mean_std(&samples);
                let how = if joined { "joined" } else { "one a call" };
                println!(
                    "| pp{len} x{rows} | {rows} | {calls} ({how}) | {:.1} ± {:.1} | {:.0} |",
                    time * 1e3,
                    std * 1e3,
                    (rows * len) as f64 / time
                );
            }
            for slot in 0..rows {
                backend.release(slot);
            }
        }
    }
    Ok(())
}

/// Prefills `texts[i]` into slot i, one prompt a call or `joined` into passes of whole prompts of up to `budget`
/// tokens (a longer prompt alone, in chunks); returns the calls made. Each call waits for its pass.
fn prefill_all(backend: &mut CudaBatchBackend, texts: &[Vec<u32>], joined: bool, budget: usize) -> Result<usize> {
    let chunk = backend.max_prefill_tokens();
    let (mut calls, mut next) = (0, 0);
    while next < texts.len() {
        let (mut end, mut tokens) = (next, 0);
        while joined
            && end < texts.len()
            && end - next < backend.max_prefill_parts()
            && tokens + texts[end].len() <= budget
        {
            tokens += texts[end].len();
            end += 1;
        }
        if end - next >= 2 {
            let parts: Vec<PrefillPart> = (next..end)
                .map(|slot| PrefillPart {
                    slot,
                    tokens: &texts[slot],
                    cuts: &[],
                })
                .collect();
            backend.prefill_parts(&parts).map_err(fe)?;
            calls += 1;
            next = end;
            continue;
        }
        for piece in texts[next].chunks(chunk) {
            backend.prefill(next, piece).map_err(fe)?;
            calls += 1;
        }
        next += 1;
    }
    Ok(calls)
}
