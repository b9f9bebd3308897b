//! `lily bench`: llama-bench's method on the CUDA backend. For each depth, the context is first filled (random
//! state written into the KV cache and DeltaNet state, or a real prefill of random tokens), then prompt tests
//! (`-p`: that many random tokens through the step) and decode tests (`-n`: random tokens one at a time, with a
//! synchronisation after each) are timed `-r` times after one warm-up. Every decode figure comes with the bytes a
//! token moves (weights read, KV cache read and written, recurrent state read and written) and the bandwidth that
//! implies, as a share of the card's measured 4.6 TB/s.

use std::time::Instant;

use lily_model::backend::Backend;
use lily_model::config::LayerKind;
use lily_model::rng::Rng;
use serde_json::json;

use crate::driver::Result;
use crate::model::{CudaBackend, CudaModel};

/// The H200's measured device-to-device bandwidth (bytes read plus written), the reference for shares.
pub const CARD_BANDWIDTH: f64 = 4.6e12;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
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
}

pub struct Row {
    pub test: String,
    pub depth: usize,
    pub tokens_per_s: (f64, f64),
    /// Decode only: bytes a token moves.
    pub bytes_per_token: Option<f64>,
}

/// Bytes one decode step moves at context `depth` (the token attends to depth + 1 positions).
pub fn bytes_per_token(model: &CudaModel, depth: usize) -> f64 {
    let c = &model.config;
    let w = &model.weights;
    let k = c.num_experts_per_tok;
    let mut bytes = w.embed.bytes_per_row() + w.lm_head.bytes();
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

fn mean_std(samples: &[f64]) -> (f64, f64) {
    let n = samples.len() as f64;
    let mean = samples.iter().sum::<f64>() / n;
    let var = if samples.len() > 1 { samples.iter().map(|s| (s - mean).powi(2)).sum::<f64>() / (n - 1.0) } else { 0.0 };
    (mean, var.sqrt())
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
            let tokens: Vec<u32> = (0..depth).map(|_| (rng.next_u64() % vocab) as u32).collect();
            backend.prefill(&tokens).map_err(|e| crate::driver::GpuError::Other(e.to_string()))?;
            backend.model.gpu.sync()
        }
    }
}

/// Runs the plan; prints the markdown table as it goes and returns the rows.
pub fn run(backend: &mut CudaBackend, plan: &Plan) -> Result<Vec<Row>> {
    let mut rng = Rng::new(0xbe9c);
    let vocab = backend.model.config.vocab_size as u64;
    let fe = |e: lily_model::cpu::model::ForwardError| crate::driver::GpuError::Other(e.to_string());
    let fill_name = match plan.fill {
        DepthFill::Random => "random state",
        DepthFill::Prefill => "prefill",
    };
    println!("| model | device | test | depth (filled by {fill_name}) | t/s | bytes/token | GB/s | share of 4.6 TB/s |");
    println!("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |");
    let mut rows = Vec::new();
    for &depth in &plan.depths {
        let tests: Vec<(String, usize, bool)> =
            plan.prompts.iter().map(|&p| (format!("pp{p}"), p, true)).chain((plan.generate > 0).then(|| (format!("tg{}", plan.generate), plan.generate, false))).collect();
        for (name, count, is_prompt) in tests {
            let mut samples = Vec::new();
            for rep in 0..=plan.repetitions {
                set_depth(backend, depth, plan.fill, &mut rng)?;
                let tokens: Vec<u32> = (0..count).map(|_| (rng.next_u64() % vocab) as u32).collect();
                let start = Instant::now();
                if is_prompt {
                    let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
                    let at = backend.model.state.tokens.at(depth * 4);
                    backend.model.gpu.upload(at, &ids)?;
                    backend.run_steps(count)?;
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
            let (gbs, share) = match bytes {
                Some(b) => (format!("{:.0}", b * mean / 1e9), format!("{:.1}%", 100.0 * b * mean / CARD_BANDWIDTH)),
                None => ("".into(), "".into()),
            };
            println!(
                "| {} | {} | {name} | {depth} | {mean:.1} ± {std:.1} | {} | {gbs} | {share} |",
                plan.model_name,
                backend.model.gpu.name,
                bytes.map(|b| format!("{:.3} GB", b / 1e9)).unwrap_or_default()
            );
            rows.push(Row { test: name, depth, tokens_per_s: (mean, std), bytes_per_token: bytes });
        }
        if plan.profile {
            set_depth(backend, depth, plan.fill, &mut rng)?;
            let profile = backend.model.profile_step()?;
            let total: f64 = profile.entries.iter().map(|e| e.1).sum();
            println!("\nper-kernel GPU time of one un-captured step at depth {depth} (CUDA events; sum {total:.3} ms):");
            let mut entries = profile.entries;
            entries.sort_by(|a, b| b.1.total_cmp(&a.1));
            for (name, ms, count) in entries {
                println!("  {name:<18} {ms:8.3} ms  {count:4} launches  {:5.1}%", 100.0 * ms / total);
            }
            println!();
        }
    }
    Ok(rows)
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
        })).collect::<Vec<_>>(),
    })
}
