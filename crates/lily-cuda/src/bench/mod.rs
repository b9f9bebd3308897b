//! `lily bench`: llama-bench's method on the CUDA backend. For each depth, the context is first filled (random
//! state written into the KV cache and DeltaNet state, or a real prefill of random tokens), then prompt tests
//! (`-p`: that many random tokens through the prefill, up to the first token's logits) and decode tests (`-n`:
//! random tokens one at a time, with a synchronisation after each) are timed `-r` times after one warm-up. Every
//! decode figure comes with the bytes a token moves (weights read, KV cache read and written, recurrent state read
//! and written) and the bandwidth that implies, as a share of the card's measured 4.6 TB/s; every prompt figure with
//! the FLOP/s it implies, as a share of the card's measured ~790 TFLOP/s (bf16 dense).

pub mod batched;
pub mod timeline;

use std::time::Instant;

use lily_model::backend::Backend;
use lily_model::config::LayerKind;
use lily_model::rng::Rng;
use serde_json::json;

use crate::driver::Result;
use crate::model::{CudaBackend, CudaModel};

/// The H200's measured device-to-device bandwidth (bytes read plus written), the reference for shares.
pub const CARD_BANDWIDTH: f64 = 4.6e12;
/// The H200's measured dense bf16 tensor-core throughput, the reference for prefill shares.
pub const CARD_BF16_FLOPS: f64 = 790e12;

/// How the context is filled before the timed part.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DepthFill {
    /// Random keys, values and recurrent state written directly.
    Random,
    /// A real prefill of random tokens.
    Prefill,
}

pub struct Plan {
    pub model_name: String,
    pub prompts: Vec<usize>,
    pub generate: usize,
    pub depths: Vec<usize>,
    pub repetitions: usize,
    pub fill: DepthFill,
    pub profile: bool,
    /// Also time each kernel inside the captured step (the kernels were loaded with the timeline).
    pub timeline: bool,
}

pub struct Row {
    pub test: String,
    pub depth: usize,
    pub tokens_per_s: (f64, f64),
    /// Decode only: bytes a token moves.
    pub bytes_per_token: Option<f64>,
    /// Prompt only: floating-point operations a token takes.
    pub flops_per_token: Option<f64>,
}

/// Floating-point operations of one prompt token, averaged over a prompt of `count` tokens after `depth`: the
/// matrix products of the weights it uses (the head only for the last token, so not counted) and attention's
/// scores and values over the positions it sees. The DeltaNet's chunked recurrence (under 3% at the full shape) is
/// not counted.
pub fn flops_per_prompt_token(model: &CudaModel, depth: usize, count: usize) -> f64 {
    let c = &model.config;
    let w = &model.weights;
    let macs = |m: &crate::weights::GpuMatrix| (m.rows * m.cols) as f64;
    let mut per_token = 0.0;
    for layer in &w.layers {
        per_token += match &layer.mixer {
            crate::weights::GpuMixer::Linear(g) => macs(&g.in_proj) + macs(&g.out_proj),
            crate::weights::GpuMixer::Full(a) => {
                let seen = depth as f64 + (count as f64 + 1.0) / 2.0;
                macs(&a.qkv) + macs(&a.o_proj) + 2.0 * (c.num_attention_heads * c.head_dim) as f64 * seen
            }
        };
        per_token += macs(&layer.router) + macs(&layer.shared_gate) + macs(&layer.shared_up) + macs(&layer.shared_down);
        per_token += (c.num_experts_per_tok * 3 * c.moe_intermediate_size * c.hidden_size) as f64;
    }
    2.0 * per_token
}

/// Bytes one decode step moves at context `depth` (the token attends to depth + 1 positions).
pub fn bytes_per_token(model: &CudaModel, depth: usize) -> f64 {
    let c = &model.config;
    let w = &model.weights;
    let k = c.num_experts_per_tok;
    let mut bytes = w.embed_tokens.bytes_per_row() + w.lm_head.bytes();
    for layer in &w.layers {
        bytes += match &layer.mixer {
            crate::weights::GpuMixer::Linear(g) => g.in_proj.bytes() + g.out_proj.bytes(),
            crate::weights::GpuMixer::Full(a) => a.qkv.bytes() + a.o_proj.bytes(),
        };
        bytes += layer.router.bytes();
        bytes += k * c.moe_intermediate_size * (layer.experts_gate.bytes_per_row() + layer.experts_up.bytes_per_row());
        bytes += k * c.hidden_size * layer.experts_down.bytes_per_row();
        bytes += layer.shared_gate.bytes() + layer.shared_up.bytes() + layer.shared_down.bytes();
    }
    let kv_row = c.kv_dim() * 2 * 2;
    let full = c.layer_types.iter().filter(|t| **t == LayerKind::Full).count();
    bytes += full * ((depth + 1) * kv_row + kv_row);
    let state = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4;
    let conv = c.linear_conv_kernel_dim * c.linear_conv_dim() * 4;
    bytes += c.num_linear_layers() * (2 * state + conv);
    bytes as f64
}

/// The mean and the sample standard deviation of `samples` (0 for one sample).
pub fn mean_std(samples: &[f64]) -> (f64, f64) {
    let n = samples.len() as f64;
    let mean = samples.iter().sum::<f64>() / n;
    let var = if samples.len() > 1 {
        samples.iter().map(|s| (s - mean).powi(2)).sum::<f64>() / (n - 1.0)
    } else {
        0.0
    };
    (mean, var.sqrt())
}

/// `count` token ids drawn uniformly below `vocab` (llama-bench's random tokens).
fn random_tokens(rng: &mut Rng, vocab: u64, count: usize) -> Vec<u32> {
    (0..count).map(|_| (rng.next_u64() % vocab) as u32).collect()
}

fn set_depth(backend: &mut CudaBackend, depth: usize, fill: DepthFill, rng: &mut Rng) -> Result<()> {
    backend.clear()?;
    if depth == 0 {
        return Ok(());
    }
    match fill {
        DepthFill::Random => backend.set_random_context(depth, rng.next_u64()),
        DepthFill::Prefill => {
            let vocab = backend.model.config.vocab_size as u64;
            let tokens = random_tokens(rng, vocab, depth);
            backend
                .prefill(&tokens)
                .map_err(|e| crate::driver::GpuError::Other(e.to_string()))?;
            backend.model.gpu.sync()
        }
    }
}

/// Runs the plan; prints the markdown table as it goes and returns the rows.
pub fn run(backend: &mut CudaBackend, plan: &Plan) -> Result<Vec<Row>> {
    let mut rng = Rng::new(0xbe9c);
    let vocab = backend.model.config.vocab_size as u64;
    let fe = |e: lily_model::ForwardError| crate::driver::GpuError::Other(e.to_string());
    let fill_name = match plan.fill {
        DepthFill::Random => "random state",
        DepthFill::Prefill => "prefill",
    };
    println!("| model | device | test | depth (filled by {fill_name}) | t/s | bytes/token | GB/s | share of 4.6 TB/s | TFLOP/s | share of 790 TFLOP/s |");
    println!("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    let mut rows = Vec::new();
    let timeline = if plan.timeline {
        Some(timeline::Timeline::attach(backend)?)
    } else {
        None
    };
    for &depth in &plan.depths {
        let tests: Vec<(String, usize, bool)> = plan
            .prompts
            .iter()
            .map(|&p| (format!("pp{p}"), p, true))
            .chain((plan.generate > 0).then(|| (format!("tg{}", plan.generate), plan.generate, false)))
            .collect();
        for (name, count, is_prompt) in tests {
            let mut samples = Vec::new();
            for rep in 0..=plan.repetitions {
                set_depth(backend, depth, plan.fill, &mut rng)?;
                let tokens = random_tokens(&mut rng, vocab, count);
                let start = Instant::now();
                if is_prompt {
                    backend.extend(&tokens).map_err(fe)?;
                    backend.model.gpu.sync()?;
                } else {
                    for &t in &tokens {
                        backend.decode(t).map_err(fe)?;
                        backend.read_next_token()?;
                    }
                }
                let secs = start.elapsed().as_secs_f64();
                if rep > 0 {
                    samples.push(count as f64 / secs);
                }
            }
            let (mean, std) = mean_std(&samples);
            let bytes = (!is_prompt).then(|| bytes_per_token(&backend.model, depth + count / 2));
            let flops = is_prompt.then(|| flops_per_prompt_token(&backend.model, depth, count));
            let (gbs, share) = match bytes {
                Some(b) => (
                    format!("{:.0}", b * mean / 1e9),
                    format!("{:.1}%", 100.0 * b * mean / CARD_BANDWIDTH),
                ),
                None => ("".into(), "".into()),
            };
            let (tflops, flop_share) = match flops {
                Some(f) => (
                    format!("{:.1}", f * mean / 1e12),
                    format!("{:.1}%", 100.0 * f * mean / CARD_BF16_FLOPS),
                ),
                None => ("".into(), "".into()),
            };
            println!(
                "| {} | {} | {name} | {depth} | {mean:.1} ± {std:.1} | {} | {gbs} | {share} | {tflops} | {flop_share} |",
                plan.model_name,
                backend.model.gpu.name,
                bytes.map(|b| format!("{:.3} GB", b / 1e9)).unwrap_or_default()
            );
            rows.push(Row {
                test: name,
                depth,
                tokens_per_s: (mean, std),
                bytes_per_token: bytes,
                flops_per_token: flops,
            });
        }
        if plan.profile {
            for &count in &plan.prompts {
                set_depth(backend, depth, plan.fill, &mut rng)?;
                let ids = random_tokens(&mut rng, vocab, count);
                backend
                    .model
                    .gpu
                    .upload(backend.model.state.tokens.at(depth).cast::<u32>(), &ids)?;
                let mut profile = crate::launch::Profile::default();
                backend.model.enqueue_prefill(depth, count, Some(&mut profile))?;
                profile.collect()?;
                print_profile(&format!("a {count}-token prefill"), depth, profile);
            }
        }
        if plan.profile && plan.generate > 0 {
            set_depth(backend, depth, plan.fill, &mut rng)?;
            let profile = backend.model.profile_step()?;
            print_profile("one un-captured decode step", depth, profile);
            let synced = rows.last().map(|r| r.tokens_per_s.0).unwrap_or(0.0);
            set_depth(backend, depth, plan.fill, &mut rng)?;
            let tokens = random_tokens(&mut rng, vocab, plan.generate);
            let start = Instant::now();
            for &t in &tokens {
                backend.decode(t).map_err(fe)?;
            }
            backend.model.gpu.sync()?;
            let queued = tokens.len() as f64 / start.elapsed().as_secs_f64();
            println!(
                "{} decode steps queued at depth {depth} with one synchronisation at the end: {queued:.1} tok/s; the synchronisation after every token costs {:.1} us a token\n",
                tokens.len(),
                1e6 / synced - 1e6 / queued
            );
        }
        if let Some(timeline) = &timeline {
            for &count in &plan.prompts {
                set_depth(backend, depth, plan.fill, &mut rng)?;
                let ids = random_tokens(&mut rng, vocab, count);
                // A kernel whose first block skips its wait leaves no reading: then the pass is not attributed, and
                // the benchmark goes on.
                match timeline.measure_prefill(backend, depth, &ids) {
                    Ok((profile, span, (last, _))) => {
                        println!(
                            "\ninside a {count}-token prefill at depth {depth} (from each kernel's wait returning to \
                             the next one's; {span:.3} ms from the first kernel's wait to the last one's, {last}, \
                             which is not counted):"
                        );
                        println!("{}", profile.report("  ", 24));
                    }
                    Err(e) => println!("\nthe timeline of a {count}-token prefill at depth {depth}: {e}"),
                }
            }
        }
        if let (Some(timeline), true) = (&timeline, plan.generate > 1) {
            set_depth(backend, depth, plan.fill, &mut rng)?;
            let tokens = random_tokens(&mut rng, vocab, plan.generate);
            let entries = timeline.measure(backend, &tokens)?;
            let step: f64 = entries.iter().map(|e| e.us_per_step).sum();
            println!(
                "\ninside the captured decode step at depth {depth} ({} tokens; from each kernel's wait returning to the next one's; step {step:.1} us, {:.1} tok/s):",
                tokens.len(),
                1e6 / step
            );
            println!("| kernel | launches | us a launch | us a step | share |\n| --- | ---: | ---: | ---: | ---: |");
            for e in entries {
                println!(
                    "| {} | {} | {:.2} | {:.1} | {:.1}% |",
                    e.kernel,
                    e.launches,
                    e.us_per_step / e.launches as f64,
                    e.us_per_step,
                    100.0 * e.us_per_step / step
                );
            }
            println!();
        }
    }
    Ok(rows)
}

fn print_profile(what: &str, depth: usize, profile: crate::launch::Profile) {
    let total: f64 = profile.entries.iter().map(|e| e.1).sum();
    println!("\nper-kernel GPU time of {what} at depth {depth} (CUDA events; sum {total:.3} ms):");
    println!("{}", profile.report("  ", 24));
}

pub fn to_json(plan: &Plan, device: &str, rows: &[Row]) -> serde_json::Value {
    json!({
        "model": plan.model_name,
        "device": device,
        "depth_fill": format!("{:?}", plan.fill).to_lowercase(),
        "repetitions": plan.repetitions,
        "card_bandwidth_bytes_per_s": CARD_BANDWIDTH,
        "results": rows.iter().map(|r| json!({
            "test": r.test,
            "depth": r.depth,
            "tokens_per_s_mean": r.tokens_per_s.0,
            "tokens_per_s_std": r.tokens_per_s.1,
            "bytes_per_token": r.bytes_per_token,
            "bandwidth_bytes_per_s": r.bytes_per_token.map(|b| b * r.tokens_per_s.0),
            "bandwidth_share": r.bytes_per_token.map(|b| b * r.tokens_per_s.0 / CARD_BANDWIDTH),
            "flops_per_token": r.flops_per_token,
            "flops_per_s": r.flops_per_token.map(|f| f * r.tokens_per_s.0),
            "flops_share": r.flops_per_token.map(|f| f * r.tokens_per_s.0 / CARD_BF16_FLOPS),
        })).collect::<Vec<_>>(),
    })
}
