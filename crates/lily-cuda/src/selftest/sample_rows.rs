//! `lily selftest`'s checks of the batched sampler (`sample_rows` in kernels/sampling.cu, src/sample_rows.rs)
//! against the host `Sampler` on the same logits: the same token in every row, exactly (the draws share the random
//! stream and the arithmetic; only a uniform within a rounding of a probability boundary could part them).

use lily_model::backend::Backend;
use lily_model::rng::Rng;
use lily_model::sampling::{kept_within_head, Sampler, SamplingParams, HEAD};
use lily_model::Config;

use super::{normals, Report};
use crate::driver::{Gpu, GpuError, Result};
use crate::kernels::sampling::RowParams;
use crate::kernels::Kernels;
use crate::launch::Launcher;
use crate::model::CudaBackend;
use crate::sample_rows::{on_device, SampleRows};

/// Rows per launch, and launches (fresh logits and parameters each).
const ROWS: usize = 64;
const ROUNDS: usize = 4;

/// One row's logits: `kind` 0 normals, 1 normals rounded to halves (many exact ties, also at the top-k
/// boundary), 2 one peaked token over normals (top-p and min-p cut early), 3 a few distinct values only.
fn row_logits(rng: &mut Rng, vocab: usize, kind: usize) -> Vec<f32> {
    let scale = 1.0 + 3.0 * rng.uniform();
    let mut l = normals(rng, vocab, scale);
    match kind {
        1 => l.iter_mut().for_each(|v| *v = (*v * 2.0).round() / 2.0),
        2 => l[(rng.next_u64() % vocab as u64) as usize] += 6.0 * scale,
        3 => l.iter_mut().for_each(|v| *v = (*v).round().clamp(-2.0, 2.0)),
        _ => {}
    }
    l
}

/// Row `i`'s parameters: greedy (by temperature or top-k 1), the whole softmax (no top-k, top-p or min-p), top-p or
/// min-p without a top-k, a top-k past the GPU's candidates (sampled on the host), and top-k alone and with top-p
/// and min-p at several temperatures.
fn row_params(rng: &mut Rng, i: usize) -> SamplingParams {
    let pick = |rng: &mut Rng, xs: &[f32]| xs[(rng.next_u64() % xs.len() as u64) as usize];
    let seed = rng.next_u64();
    let temperature = pick(rng, &[0.3, 0.7, 1.0, 1.5]);
    let top_k = [2usize, 5, 10, 40, 64, 200, HEAD][(rng.next_u64() % 7) as usize];
    match i % 8 {
        0 => SamplingParams {
            seed,
            ..Default::default()
        },
        1 => SamplingParams {
            temperature,
            top_k: 1,
            seed,
            ..Default::default()
        },
        2 | 3 => SamplingParams {
            temperature,
            top_k: 0,
            seed,
            ..Default::default()
        },
        4 => SamplingParams {
            temperature,
            top_k: 0,
            top_p: pick(rng, &[1.0, 0.95, 0.8]),
            min_p: if rng.uniform() < 0.5 { 0.05 } else { 0.0 },
            seed,
        },
        5 => SamplingParams {
            temperature,
            top_k: HEAD + 36,
            seed,
            ..Default::default()
        },
        _ => SamplingParams {
            temperature,
            top_k,
            top_p: pick(rng, &[1.0, 1.0, 0.95, 0.8, 0.5]),
            min_p: pick(rng, &[0.0, 0.0, 0.05, 0.2]),
            seed,
        },
    }
}

/// Row `i`'s mask, for about half the rows: about one token in eight; three tokens (fewer than most top-k, so
/// masked tokens fill the candidates); a single token; a mask shorter than the vocabulary.
fn row_mask(rng: &mut Rng, vocab: usize, i: usize) -> Option<Vec<u32>> {
    let words = vocab.div_ceil(32);
    let mut mask = vec![0u32; words];
    let allow = |t: usize, mask: &mut Vec<u32>| mask[t / 32] |= 1 << (t % 32);
    match (i / 8) % 6 {
        0 | 1 => {
            for w in mask.iter_mut() {
                *w = (rng.next_u64() & rng.next_u64() & rng.next_u64()) as u32;
            }
        }
        2 => (0..3).for_each(|_| allow((rng.next_u64() % vocab as u64) as usize, &mut mask)),
        3 => allow((rng.next_u64() % vocab as u64) as usize, &mut mask),
        4 => {
            mask.truncate(words / 2);
            mask.iter_mut().for_each(|w| *w = rng.next_u64() as u32);
        }
        _ => return None,
    }
    // Bits past the vocabulary allow nothing: every mask lets at least one token through, as `Pick` promises.
    if !(0..vocab).any(|t| mask.get(t / 32).is_some_and(|w| w & (1 << (t % 32)) != 0)) {
        mask[0] |= 1;
    }
    Some(mask)
}

/// Counts of rows compared and rows that differ, by kind of row.
#[derive(Default)]
struct Tally {
    rows: usize,
    differ: usize,
    first: Option<String>,
}

impl Tally {
    fn add(&mut self, equal: bool, detail: impl FnOnce() -> String) {
        self.rows += 1;
        if !equal {
            self.differ += 1;
            self.first.get_or_insert_with(detail);
        }
    }
    fn report(&self, name: &str, report: &mut Report) {
        let detail = match &self.first {
            None => format!("{} rows equal", self.rows),
            Some(first) => format!("{} of {} rows differ, first: {first}", self.differ, self.rows),
        };
        report.check_eq(name, self.rows > 0 && self.differ == 0, &detail);
    }
}

/// `sample_rows` on `ROUNDS` launches of `ROWS` rows of random logits with mixed parameters and masks against the
/// host `Sampler`, token for token.
pub(super) fn check(gpu: &Gpu, kernels: &Kernels, c: &Config, seed: u64, report: &mut Report) -> Result<()> {
    let vocab = c.vocab_size;
    let mut rng = Rng::new(seed ^ 0x05a3_b1e5);
    let mut sampler_rows = SampleRows::new(gpu, ROWS, vocab)?;
    let logits_dev = gpu.alloc::<f32>(ROWS * vocab)?;
    let [mut greedy, mut sampled, mut whole, mut nucleus, mut masked, mut host_rows, mut left]: [Tally; 7] =
        Default::default();
    let mut distinct = std::collections::BTreeSet::new();
    for _ in 0..ROUNDS {
        let logits: Vec<Vec<f32>> = (0..ROWS)
            .map(|i| row_logits(&mut rng, vocab, (i + i / 8) % 4))
            .collect();
        let params: Vec<SamplingParams> = (0..ROWS).map(|i| row_params(&mut rng, i)).collect();
        let masks: Vec<Option<Vec<u32>>> = (0..ROWS).map(|i| row_mask(&mut rng, vocab, i)).collect();
        let flat: Vec<f32> = logits.iter().flatten().copied().collect();
        gpu.upload(logits_dev.ptr(), &flat)?;
        // Each row's host sampler and the device row's counter come from the same point of the stream: a few
        // draws in, as a sequence part-way through its output.
        let mut hosts = Vec::with_capacity(ROWS);
        let mut rows = Vec::with_capacity(ROWS);
        // The last row draws from the first row's logits (as the choices of one request share theirs).
        let source = |i: usize| if i == ROWS - 1 { 0 } else { i };
        for (i, p) in params.iter().enumerate() {
            let (mut host, mut device) = (Sampler::new(p.clone()), Sampler::new(p.clone()));
            for _ in 0..rng.next_u64() % 5 {
                host.next_draw();
                device.next_draw();
            }
            let counter = if p.is_greedy() { 0 } else { device.next_draw() };
            rows.push(RowParams {
                logits_row: source(i) as i32,
                ..RowParams::new(p, counter)
            });
            hosts.push(host);
        }
        let mask_refs: Vec<Option<&[u32]>> = masks.iter().map(|m| m.as_deref()).collect();
        sampler_rows.enqueue(&mut Launcher::new(gpu, kernels), logits_dev.ptr(), &rows, &mask_refs)?;
        gpu.sync()?;
        let got = sampler_rows.read();
        for (i, host) in hosts.iter_mut().enumerate() {
            let p = &params[i];
            let mut row = logits[source(i)].clone();
            let want = match &masks[i] {
                Some(mask) => host.sample_masked(&mut row, mask),
                None => host.sample(&row),
            };
            let detail = || {
                format!(
                    "row {i} ({p:?}, mask {}): {} vs {want}",
                    masks[i].is_some(),
                    got[i] as i32
                )
            };
            if !on_device(p) {
                host_rows.add(got[i] == u32::MAX, detail);
                continue;
            }
            // A row without a top-k whose top-p or min-p keeps tokens past the head is left to the host, and only
            // such a row (`row` is masked now, as the host sampler saw it).
            let cut = !p.is_greedy() && p.top_k == 0 && (p.top_p < 1.0 || p.min_p > 0.0);
            let past_head = cut && !kept_within_head(p, &row);
            if got[i] == u32::MAX || past_head {
                left.add(got[i] == u32::MAX && past_head, detail);
                continue;
            }
            let tally: &mut Tally = match (masks[i].is_some(), p.is_greedy()) {
                _ if cut => &mut nucleus,
                (true, _) => &mut masked,
                (false, true) => &mut greedy,
                (false, false) if p.top_k == 0 => &mut whole,
                (false, false) => &mut sampled,
            };
            tally.add(got[i] == want, detail);
            if !p.is_greedy() {
                distinct.insert(got[i]);
            }
        }
    }
    greedy.report("sample_rows: greedy rows == argmax (ties: lowest id)", report);
    sampled.report("sample_rows: top-k/top-p/min-p rows == host Sampler", report);
    whole.report("sample_rows: whole-softmax rows (no top-k) == host Sampler", report);
    nucleus.report(
        "sample_rows: top-p/min-p rows without a top-k (masked or not) == host Sampler",
        report,
    );
    left.report(
        "sample_rows: rows whose top-p/min-p runs past the head are left to the host, only those",
        report,
    );
    masked.report("sample_rows: masked rows == host Sampler.sample_masked", report);
    host_rows.report(
        "sample_rows: rows of a top-k past the candidates are left to the host",
        report,
    );
    report.check_eq(
        "sample_rows: sampled rows draw varied tokens",
        distinct.len() > 10,
        &format!("{} distinct tokens", distinct.len()),
    );
    check_not_finite(gpu, kernels, &mut sampler_rows, &logits_dev, vocab, &mut rng, report)?;
    let too_many = vec![RowParams::new(&SamplingParams::default(), 0); ROWS + 1];
    let refused = sampler_rows.enqueue(&mut Launcher::new(gpu, kernels), logits_dev.ptr(), &too_many, &[]);
    report.check_eq(
        "sample_rows: more rows than its buffers hold are refused",
        matches!(refused, Err(GpuError::Other(_))),
        &format!("{} rows", ROWS + 1),
    );
    Ok(())
}

/// Greedy rows of logits that are not finite against the host's `argmax`: all NaN (token 0), NaN at every even id,
/// NaN at id 0 only, negative infinity but for one NaN, and all NaN under a mask (token 0, allowed or not, as
/// `sample_masked`). Each is a token of the vocabulary, never the kernel's starting index past it.
fn check_not_finite(
    gpu: &Gpu,
    kernels: &Kernels,
    sampler_rows: &mut SampleRows,
    logits_dev: &crate::driver::DevBuf<f32>,
    vocab: usize,
    rng: &mut Rng,
    report: &mut Report,
) -> Result<()> {
    let mut rows: Vec<Vec<f32>> = Vec::new();
    rows.push(vec![f32::NAN; vocab]);
    let mut l = normals(rng, vocab, 1.0);
    l.iter_mut().step_by(2).for_each(|v| *v = f32::NAN);
    rows.push(l);
    let mut l = normals(rng, vocab, 1.0);
    l[0] = f32::NAN;
    rows.push(l);
    let mut l = vec![f32::NEG_INFINITY; vocab];
    l[vocab / 2] = f32::NAN;
    rows.push(l);
    rows.push(vec![f32::NAN; vocab]);
    let mut mask = vec![0u32; vocab.div_ceil(32)];
    mask[(vocab / 2) / 32] |= 1 << ((vocab / 2) % 32);
    let masks: Vec<Option<&[u32]>> = (0..rows.len())
        .map(|i| (i == rows.len() - 1).then_some(&mask[..]))
        .collect();
    let flat: Vec<f32> = rows.iter().flatten().copied().collect();
    gpu.upload(logits_dev.ptr(), &flat)?;
    let params: Vec<RowParams> = (0..rows.len())
        .map(|i| RowParams {
            logits_row: i as i32,
            ..RowParams::new(&SamplingParams::default(), 0)
        })
        .collect();
    sampler_rows.enqueue(&mut Launcher::new(gpu, kernels), logits_dev.ptr(), &params, &masks)?;
    gpu.sync()?;
    let got = sampler_rows.read();
    let mut tally = Tally::default();
    for (i, row) in rows.iter().enumerate() {
        let mut row = row.clone();
        let want = match masks[i] {
            Some(mask) => Sampler::new(SamplingParams::default()).sample_masked(&mut row, mask),
            None => Sampler::new(SamplingParams::default()).sample(&row),
        };
        tally.add(got[i] == want && (got[i] as usize) < vocab, || {
            format!("row {i}: {} vs {want}", got[i] as i32)
        });
    }
    tally.report(
        "sample_rows: greedy rows of NaN or infinite logits == host argmax, within the vocabulary",
        report,
    );
    Ok(())
}

/// The single-sequence backend's `sample` and `sample_masked` (GPU draws) against the host `Sampler` on the
/// backend's own logits after a prefill: the next token for several parameters and masks, at several draws.
pub(super) fn check_backend(gpu: &mut CudaBackend, seed: u64, report: &mut Report) -> Result<()> {
    let fe = |e: lily_model::ForwardError| GpuError::Other(e.to_string());
    let vocab = gpu.config().vocab_size;
    let mut rng = Rng::new(seed ^ 0x0bac_e4d0);
    let prompt: Vec<u32> = (0..7).map(|_| (rng.next_u64() % vocab as u64) as u32).collect();
    gpu.prefill(&prompt).map_err(fe)?;
    let logits = gpu.logits().map_err(fe)?.to_vec();
    let mut tally = Tally::default();
    for i in 0..48 {
        let p = match row_params(&mut rng, i) {
            p if on_device(&p) => p,
            p => SamplingParams { top_k: 16, ..p },
        };
        let mask = row_mask(&mut rng, vocab, i);
        let (mut host, mut device) = (Sampler::new(p.clone()), Sampler::new(p.clone()));
        for _ in 0..1 + rng.next_u64() % 3 {
            let (got, want) = match &mask {
                Some(m) => (
                    gpu.sample_masked(&mut device, m).map_err(fe)?,
                    host.sample_masked(&mut logits.clone(), m),
                ),
                None => (gpu.sample(&mut device).map_err(fe)?, host.sample(&logits)),
            };
            tally.add(got == want, || {
                format!("{p:?}, mask {}: {got} vs {want}", mask.is_some())
            });
        }
    }
    tally.report("CudaBackend sample / sample_masked == host Sampler", report);
    Ok(())
}
