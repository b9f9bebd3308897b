//! The batched backend end to end: many sequences of mixed prompt lengths joining and leaving a batch at
//! different steps give the same greedy tokens as each alone, and their logits stay within the end-to-end
//! tolerance of the CPU backend's; `fork` continues a sequence as the original does.

use lily_model::backend::{Backend, BatchBackend, CpuBackend, Pick, PrefillPart, StepRow};
use lily_model::cpu::CpuModel;
use lily_model::rng::Rng;
use lily_model::sampling::Sampler;
use lily_model::weights::Weights;

use super::{logit_gap, rel_err, Report};
use crate::batch::CudaBatchBackend;
use crate::driver::{GpuError, Result};

/// Relative logit gap below which two greedy choices count as a near-tie that rounding may flip. A row's logits in a
/// batch and alone differ by the rounding of sums split by row count, and more where the rounding flips one of a
/// token's top-8 experts at a routing near-tie: up to ~1e-2 of the largest logit has been seen on the default model
/// (two of 64 sequences parting at gaps of 1.9e-3 and 1.1e-2), so choices closer than 2e-2 may part.
const NEAR_TIE: f32 = 2e-2;

/// The GPU's end-to-end tolerance against the CPU on this check's random prompts (relative to the largest logit),
/// as `logits_vs_cpu` holds it.
const END_TO_END: f32 = 6e-2;

/// How far from the CPU's a run's logits may be where the CPU's routing had a near-tie, so that the run may have
/// chosen one expert otherwise. One such expert moves the default model's logits by up to ~1e-1 of the largest:
/// on the CPU, choosing the ninth expert at a near-tie (margin 6.7e-5) of the second layer moved a 57-token
/// prompt's logits by 1.0e-1 and made its third most likely token the first. A run that read another sequence's
/// rows or a stale state would give another sequence's logits, not ones this close.
const FLIPPED_EXPERT: f32 = 2e-1;

/// The CPU's view of a sequence that parts between the batch and alone: its logits after `prompt` and `tokens` and
/// the smallest top-8 routing margin over all of them (a margin under `ROUTING_NEAR_TIE` means a GPU path's rounding
/// may have chosen another expert for some token there, which moves every later logit of the sequence).
fn cpu_view(cpu: &mut CpuBackend, prompt: &[u32], tokens: &[u32]) -> Result<(Vec<f32>, f32)> {
    cpu.prefill(prompt).map_err(fe)?;
    let mut margin = cpu.route_margin();
    for &token in tokens {
        cpu.decode(token).map_err(fe)?;
        margin = margin.min(cpu.route_margin());
    }
    Ok((cpu.logits().map_err(fe)?.to_vec(), margin))
}

/// The next-token logits of `prompt` followed by `tokens` (greedy decoding's inputs), run alone in `slot`.
fn logits_after(backend: &mut CudaBatchBackend, slot: usize, prompt: &[u32], tokens: &[u32]) -> Result<Vec<f32>> {
    backend.release(slot);
    if !backend.reserve(slot, prompt.len() + tokens.len() + 1).map_err(fe)? {
        return Err(GpuError::Other("no KV pages for the near-tie check".into()));
    }
    for piece in prompt.chunks(backend.max_prefill_tokens()) {
        backend.prefill(slot, piece).map_err(fe)?;
    }
    for &token in tokens {
        backend.step(&[StepRow { slot, token }]).map_err(fe)?;
    }
    let logits = backend.logits(0).map_err(fe)?.to_vec();
    backend.release(slot);
    Ok(logits)
}

/// One sequence of the test: its prompt, the step at which it joins, and the tokens it generated. Where `expected`
/// holds the tokens of another run (the sequence alone), `diverged` keeps this run's logits at the first step whose
/// greedy token differs from them.
struct Seq {
    prompt: Vec<u32>,
    joins: usize,
    slot: usize,
    tokens: Vec<u32>,
    expected: Vec<u32>,
    diverged: Option<Vec<f32>>,
}

impl Seq {
    fn new(prompt: Vec<u32>, joins: usize, slot: usize) -> Seq {
        Seq {
            prompt,
            joins,
            slot,
            tokens: Vec::new(),
            expected: Vec::new(),
            diverged: None,
        }
    }

    /// Appends `token`, picked from output row `row` of the last call; at the first departure from `expected`, keeps
    /// that row's logits.
    fn push(&mut self, backend: &mut CudaBatchBackend, row: usize, token: u32) -> Result<()> {
        let departs = self.expected.get(self.tokens.len()).is_some_and(|&e| e != token);
        if departs && self.diverged.is_none() {
            self.diverged = Some(backend.logits(row).map_err(fe)?.to_vec());
        }
        self.tokens.push(token);
        Ok(())
    }
}

fn fe(e: lily_model::ForwardError) -> GpuError {
    GpuError::Other(e.to_string())
}

/// Greedy picks for the output rows `rows` of the last call.
fn greedy(backend: &mut CudaBatchBackend, rows: &[usize]) -> Result<Vec<u32>> {
    let mut samplers: Vec<Sampler> = rows.iter().map(|_| Sampler::new(Default::default())).collect();
    let mut picks: Vec<Pick> = rows
        .iter()
        .zip(&mut samplers)
        .map(|(&row, sampler)| Pick {
            row,
            sampler,
            allowed: None,
        })
        .collect();
    backend.sample(&mut picks).map_err(fe)
}

/// Runs `seqs` through `backend`: sequence i is prefilled (in chunks of at most `max_prefill_tokens`, or in one
/// pass with others joining at the same step where they fit one call) at step `joins`, then takes one greedy token
/// per step until it has `generate` tokens, and leaves (its slot released).
fn run(backend: &mut CudaBatchBackend, seqs: &mut [Seq], generate: usize) -> Result<()> {
    let chunk = backend.max_prefill_tokens();
    let mut step = 0;
    while seqs.iter().any(|s| s.tokens.len() < generate) {
        let joining: Vec<usize> = (0..seqs.len()).filter(|&i| seqs[i].joins == step).collect();
        for &i in &joining {
            let needed = seqs[i].prompt.len() + generate;
            if !backend.reserve(seqs[i].slot, needed).map_err(fe)? {
                return Err(GpuError::Other(format!("no KV pages for {needed} tokens")));
            }
        }
        // The prompts that join at this step go through one prefill pass where they fit one call together.
        let (mut together, mut used) = (Vec::new(), 0);
        for &i in &joining {
            if used + seqs[i].prompt.len() <= chunk && together.len() < backend.max_prefill_parts() {
                used += seqs[i].prompt.len();
                together.push(i);
            }
        }
        if together.len() > 1 {
            let parts: Vec<PrefillPart> = together
                .iter()
                .map(|&i| PrefillPart {
                    slot: seqs[i].slot,
                    tokens: &seqs[i].prompt,
                    cuts: &[],
                })
                .collect();
            backend.prefill_parts(&parts).map_err(fe)?;
            let chosen = greedy(backend, &(0..together.len()).collect::<Vec<_>>())?;
            for (row, (&i, token)) in together.iter().zip(chosen).enumerate() {
                seqs[i].push(backend, row, token)?;
            }
        }
        for &i in joining.iter().filter(|&i| together.len() < 2 || !together.contains(i)) {
            let s = &mut seqs[i];
            for piece in s.prompt.chunks(chunk) {
                backend.prefill(s.slot, piece).map_err(fe)?;
            }
            let token = greedy(backend, &[0])?[0];
            s.push(backend, 0, token)?;
        }
        let running: Vec<usize> = (0..seqs.len())
            .filter(|&i| seqs[i].joins <= step && !seqs[i].tokens.is_empty() && seqs[i].tokens.len() < generate)
            .collect();
        if !running.is_empty() {
            let rows: Vec<StepRow> = running
                .iter()
                .map(|&i| StepRow {
                    slot: seqs[i].slot,
                    token: *seqs[i].tokens.last().expect("has a token"),
                })
                .collect();
            backend.step(&rows).map_err(fe)?;
            let chosen = greedy(backend, &(0..rows.len()).collect::<Vec<_>>())?;
            for (row, (&i, token)) in running.iter().zip(chosen).enumerate() {
                seqs[i].push(backend, row, token)?;
            }
        }
        for s in seqs.iter().filter(|s| s.tokens.len() == generate) {
            if backend.len(s.slot) > 0 {
                backend.release(s.slot);
            }
        }
        step += 1;
    }
    Ok(())
}

/// `count` sequences with prompt lengths from 1 to `longest` (both included), joining over the first steps, in
/// shuffled slots, after each has run alone; then the first sequences' logits against the CPU.
pub fn check(
    backend: &mut CudaBatchBackend,
    weights: Weights,
    seed: u64,
    count: usize,
    longest: usize,
    report: &mut Report,
) -> Result<()> {
    let generate = 12;
    let vocab = backend.config().vocab_size as u64;
    let mut rng = Rng::new(seed ^ 0xba7c);
    let slots = super::shuffled(&mut rng, backend.max_seqs());
    let mut seqs: Vec<Seq> = (0..count)
        .map(|i| {
            let len = match i {
                0 => 1,
                1 => longest,
                _ => 1 + (rng.next_u64() % longest as u64) as usize,
            };
            let prompt = (0..len).map(|_| (rng.next_u64() % vocab) as u32).collect();
            Seq::new(prompt, i % 7, slots[i] as usize)
        })
        .collect();
    // Every step through the batched pass, whatever its row count, so that alone and in a batch a sequence takes
    // the same arithmetic. Each sequence runs alone first; the batch then keeps its logits where it departs.
    let sequential_below = std::mem::replace(&mut backend.sequential_below, 0);
    for s in seqs.iter_mut() {
        let mut alone = [Seq::new(s.prompt.clone(), 0, s.slot)];
        run(backend, &mut alone, generate)?;
        s.expected = std::mem::take(&mut alone[0].tokens);
    }
    let free = backend.free_tokens();
    run(backend, &mut seqs, generate)?;
    report.check_eq(
        "batched backend: every slot's KV pages returned",
        backend.free_tokens() == free,
        &format!("{} of {free} tokens free after the run", backend.free_tokens()),
    );
    // The products may split their sums by the row count (see gemm.rs), so a row's logits can differ by rounding
    // between batch sizes. Where greedy choices differ, the two candidates must be that close (a near-tie), or the
    // CPU's routing of the sequence must have had a near-tie (the rounding may then have flipped an expert in
    // either run, as `logits_vs_cpu` allows) and both runs' logits at that step be within FLIPPED_EXPERT of the
    // CPU's. The two runs may flip different experts, so the gap between their choices does not tell a flipped
    // expert from a wrong batch; each run's distance from the CPU does.
    let mut cpu = CpuBackend::new(CpuModel::new(weights), longest + generate);
    let (mut same, mut worst_gap, mut unexplained) = (0, 0.0f32, 0.0f32);
    for s in &seqs {
        let Some(at) = s.expected.iter().zip(&s.tokens).position(|(a, b)| a != b) else {
            same += 1;
            continue;
        };
        let alone = &s.expected;
        let logits = logits_after(backend, s.slot, &s.prompt, &alone[..at])?;
        let gap = logit_gap(&logits, alone[at], s.tokens[at]);
        let (cpu_logits, margin) = cpu_view(&mut cpu, &s.prompt, &alone[..at])?;
        let cpu_gap = logit_gap(&cpu_logits, alone[at], s.tokens[at]);
        let alone_err = rel_err(&logits, &cpu_logits);
        let batch_err = s.diverged.as_deref().map_or(f64::INFINITY, |b| rel_err(b, &cpu_logits));
        println!(
            "     a sequence of {} prompt tokens differs at token {at}: gap {gap:.2e} (the CPU's {cpu_gap:.2e}; its \
             smallest routing margin over the sequence {margin:.1e}; vs the CPU: alone {alone_err:.2e}, in the batch \
             {batch_err:.2e})",
            s.prompt.len(),
        );
        worst_gap = worst_gap.max(gap);
        let flipped = margin < super::ROUTING_NEAR_TIE && alone_err.max(batch_err) <= FLIPPED_EXPERT as f64;
        if gap > NEAR_TIE && !flipped {
            unexplained = unexplained.max(gap);
        }
    }
    // Near-ties are rare: most sequences must give the same tokens in the batch as alone. On the default model's
    // random prompts 2 to 9 of 64 sequences part at some near-tie within their 12 tokens (seeds 5, 7, 9, 11, 13),
    // so a quarter is far past chance; rows wrong by a little everywhere would part far more often.
    report.check_eq(
        &format!("batched backend: {count} sequences (prompts 1 ..= {longest}) vs each alone"),
        unexplained == 0.0 && 4 * same >= 3 * count,
        &format!(
            "{same} of {count} gave identical greedy tokens (at least 3 in 4 must); where not, the two choices were \
             {worst_gap:.1e} apart (a near-tie: <= {NEAR_TIE:.0e} of the largest logit, or a routing near-tie of the \
             CPU's with both runs within {FLIPPED_EXPERT:.0e} of the CPU; {unexplained:.1e} was neither)"
        ),
    );
    for (passes, below, together) in [
        ("batched pass", 0, true),
        ("batched pass", 0, false),
        ("single-row graphs", usize::MAX, false),
    ] {
        backend.sequential_below = below;
        logits_vs_cpu(backend, &mut cpu, &mut rng, passes, together, report)?;
    }
    backend.sequential_below = sequential_below;

    // A fork continues as its original: both slots step the same token and give the same logits.
    let prompt: Vec<u32> = (0..300).map(|_| (rng.next_u64() % vocab) as u32).collect();
    backend.reserve(2, prompt.len() + 2).map_err(fe)?;
    backend.reserve(5, prompt.len() + 2).map_err(fe)?;
    backend.prefill(2, &prompt).map_err(fe)?;
    backend.fork(2, 5).map_err(fe)?;
    backend
        .step(&[StepRow { slot: 2, token: 7 }, StepRow { slot: 5, token: 7 }])
        .map_err(fe)?;
    let original = backend.logits(0).map_err(fe)?.to_vec();
    let forked = backend.logits(1).map_err(fe)?.to_vec();
    report.check(
        "batched backend: a forked slot's step vs its original's",
        rel_err(&forked, &original),
        0.0,
    );
    backend.release(2);
    backend.release(5);
    Ok(())
}

/// The logits of a batch of three (prompts of 1, 40 and 300 tokens, prefilled one by one or `together` in one
/// pass, then two steps) against the CPU backend.
fn logits_vs_cpu(
    backend: &mut CudaBatchBackend,
    cpu: &mut CpuBackend,
    rng: &mut Rng,
    passes: &str,
    together: bool,
    report: &mut Report,
) -> Result<()> {
    let vocab = backend.config().vocab_size as u64;
    let prompts: Vec<Vec<u32>> = [1usize, 40, 300]
        .iter()
        .map(|&n| (0..n).map(|_| (rng.next_u64() % vocab) as u32).collect())
        .collect();
    // Where the CPU's routing had a near-tie (its top-8 margin under ROUTING_NEAR_TIE), the GPU's bf16 activations
    // may choose another expert and the logits part for a reason that is not an error: that sequence is compared
    // up to there, as `compare_models` does.
    let tol = END_TO_END as f64;
    let (mut worst, mut stopped) = (0.0f64, vec![None; prompts.len()]);
    let mut compare = |seq: usize, at: &str, err: f64, margin: f32, stopped: &mut Vec<Option<String>>| {
        if stopped[seq].is_some() {
            return;
        }
        if err > tol && margin < super::ROUTING_NEAR_TIE {
            println!("     sequence {seq}: compared up to {at}: the CPU's routing had a near-tie (margin {margin:.1e}) and the logits were {err:.2e} apart");
            stopped[seq] = Some(at.to_string());
        } else {
            worst = worst.max(err);
        }
    };
    // With `together`, the three prompts go through one prefill pass (`prefill_parts`), each into its own row.
    for (i, p) in prompts.iter().enumerate() {
        backend.reserve(i, p.len() + 2).map_err(fe)?;
    }
    if together {
        let parts: Vec<PrefillPart> = prompts
            .iter()
            .enumerate()
            .map(|(slot, tokens)| PrefillPart {
                slot,
                tokens,
                cuts: &[],
            })
            .collect();
        backend.prefill_parts(&parts).map_err(fe)?;
    }
    let mut cpu_logits = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        if !together {
            backend.prefill(i, p).map_err(fe)?;
        }
        cpu.prefill(p).map_err(fe)?;
        let row = if together { i } else { 0 };
        let err = rel_err(backend.logits(row).map_err(fe)?, cpu.logits().map_err(fe)?);
        compare(i, "the prompt", err, cpu.route_margin(), &mut stopped);
        let mut row = Vec::new();
        for token in [7u32, 11] {
            cpu.decode(token).map_err(fe)?;
            row.push((cpu.logits().map_err(fe)?.to_vec(), cpu.route_margin()));
        }
        cpu_logits.push(row);
    }
    for (step, token) in [7u32, 11].into_iter().enumerate() {
        let rows: Vec<StepRow> = (0..prompts.len()).rev().map(|slot| StepRow { slot, token }).collect();
        backend.step(&rows).map_err(fe)?;
        for (row, r) in rows.iter().enumerate() {
            let (want, margin) = &cpu_logits[r.slot][step];
            let err = rel_err(backend.logits(row).map_err(fe)?, want);
            compare(r.slot, &format!("step {}", step + 1), err, *margin, &mut stopped);
        }
    }
    let prefill = if together {
        "3 prompts in one prefill"
    } else {
        "prefills"
    };
    report.check(
        &format!("batched backend, {passes}: {prefill}, 2 steps of 3 rows vs CPU"),
        worst,
        tol,
    );

    for slot in 0..prompts.len() {
        backend.release(slot);
    }
    Ok(())
}
