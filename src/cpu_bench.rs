//! `lily bench --device cpu`: llama-bench's method on the CPU backend. For each thread count (`-t`) and depth
//! (`-d`, the context filled by a prefill of random tokens), prompt tests (`-p`: that many random tokens through the
//! prefill, up to the last token's logits) and decode tests (`-n`: random tokens one at a time) are timed `-r` times
//! after one warm-up. Every decode figure comes with the weight and state bytes a token reads and the bandwidth
//! that implies.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use lily_model::cpu::{CpuModel, DecodeRow, State};
use lily_model::quant::QMatrix;
use lily_model::rng::Rng;
use lily_model::weights::Mixer;
use lily_model::{synth, Config, Weights};

use crate::cuda_cmd::BenchArgs;
use lily_cuda::bench::mean_std;

/// Bytes of one quantized matrix (packed values, scales, biases).
fn matrix_bytes(m: &QMatrix) -> usize {
    m.packed.as_bytes().len() + m.scales.as_bytes().len() + m.biases.as_bytes().len()
}

/// Bytes one decode step reads at context `depth`: the weights it uses (one embedding row, every dense matrix, the
/// routed experts' rows of `num_experts_per_tok` experts), the keys and values of `depth + 1` positions and the
/// DeltaNet state (read and written).
fn bytes_per_token(model: &CpuModel, depth: usize) -> f64 {
    let w = &model.weights;
    let c = &w.config;
    let mut bytes = matrix_bytes(&w.embed_tokens) / c.vocab_size + matrix_bytes(&w.lm_head);
    for layer in &w.layers {
        bytes += match &layer.mixer {
            Mixer::Linear(g) => [&g.in_proj_qkv, &g.in_proj_z, &g.in_proj_b, &g.in_proj_a, &g.out_proj]
                .into_iter()
                .map(matrix_bytes)
                .sum::<usize>(),
            Mixer::Full(a) => [&a.q_proj, &a.k_proj, &a.v_proj, &a.o_proj]
                .into_iter()
                .map(matrix_bytes)
                .sum(),
        };
        let m = &layer.moe;
        bytes += [
            &m.router,
            &m.shared_gate,
            &m.shared_up,
            &m.shared_down,
            &m.shared_expert_gate,
        ]
        .into_iter()
        .map(matrix_bytes)
        .sum::<usize>();
        let experts = matrix_bytes(&m.experts_gate) + matrix_bytes(&m.experts_up) + matrix_bytes(&m.experts_down);
        bytes += experts / c.num_experts * c.num_experts_per_tok;
    }
    let kv_row = 2 * c.kv_dim() * 4;
    bytes += c.num_full_layers() * (depth + 1) * kv_row;
    let state = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4;
    bytes += c.num_linear_layers() * 2 * state;
    bytes as f64
}

fn random_tokens(rng: &mut Rng, vocab: usize, count: usize) -> Vec<u32> {
    (0..count).map(|_| (rng.next_u64() % vocab as u64) as u32).collect()
}

/// Runs `lily bench --device cpu` with the arguments of `lily bench`.
pub fn run(args: BenchArgs) -> Result<()> {
    let prompts: Vec<usize> = args.prompts.into_iter().flat_map(|l| l.0).collect();
    let depths: Vec<usize> = args.depths.into_iter().flat_map(|l| l.0).collect();
    let threads: Vec<usize> = args.threads.into_iter().flat_map(|l| l.0).collect();
    let batches: Vec<usize> = args.batch.into_iter().flat_map(|l| l.0).collect();
    if !batches.is_empty() && (!prompts.is_empty() || args.generate == 0 || batches.contains(&0)) {
        bail!("on the CPU, --batch times decode steps only: give -n, no -p, and batch sizes of at least 1");
    }
    if depths.is_empty() || args.repetitions == 0 {
        bail!("give at least one depth and one repetition");
    }
    let (model, model_name) = match args.synthetic {
        Some(shape) => {
            let mut config = shape.config_with_layers(args.layers)?;
            config.quantization = Config::from_json(&config.to_mlx_json())?.quantization;
            let name = format!(
                "synthetic {shape:?}, {} layers (4-bit, seed {})",
                config.num_hidden_layers, args.seed
            )
            .to_lowercase();
            let checkpoint = synth::checkpoint_in_memory(&config, args.seed)?;
            (CpuModel::new(Weights::from_checkpoint(config, &checkpoint)?), name)
        }
        None => {
            let dir = match args.model {
                Some(dir) => dir,
                None => lily_model::default_model::locate()?,
            };
            let weights = Weights::load(&dir).with_context(|| format!("loading {}", dir.display()))?;
            let name = dir
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            (CpuModel::new(weights), name)
        }
    };
    let c = model.config().clone();
    let longest = prompts.iter().copied().max().unwrap_or(0).max(args.generate);
    let max_context = depths.iter().max().copied().unwrap_or(0) + longest + 1;
    if max_context > c.max_position_embeddings {
        bail!(
            "depth + tokens ({max_context}) exceeds the model's {} positions",
            c.max_position_embeddings
        );
    }
    let threads = if threads.is_empty() {
        vec![rayon::current_num_threads()]
    } else {
        threads
    };
    let device = format!("cpu ({})", lily_model::cpu::linalg::simd_path().name());
    if !batches.is_empty() {
        let runs = Batched {
            threads: &threads,
            depths: &depths,
            batches: &batches,
            max_context,
            generate: args.generate,
            repetitions: args.repetitions,
        };
        return run_batched(&model, &model_name, &device, runs);
    }
    let mut state = model.new_state(max_context);
    let mut logits = vec![0.0f32; c.vocab_size];
    let mut rng = Rng::new(0xbe9c);
    println!(
        "| model | device | threads | test | depth (filled by prefill) | t/s | bytes/token | GB/s |\n| --- | --- | ---: | --- | ---: | ---: | ---: | ---: |"
    );
    for &n_threads in &threads {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(n_threads)
            .build()
            .context("starting the thread pool")?;
        let mut set_depth = |state: &mut State, rng: &mut Rng, depth: usize| -> Result<()> {
            state.reset();
            if depth > 0 {
                let tokens = random_tokens(rng, c.vocab_size, depth);
                model.prefill(state, &tokens, &mut logits)?;
            }
            Ok(())
        };
        for &depth in &depths {
            let tests: Vec<(String, usize, bool)> = prompts
                .iter()
                .map(|&p| (format!("pp{p}"), p, true))
                .chain((args.generate > 0).then(|| (format!("tg{}", args.generate), args.generate, false)))
                .collect();
            for (name, count, is_prompt) in tests {
                let mut samples = Vec::new();
                for rep in 0..=args.repetitions {
                    pool.install(|| set_depth(&mut state, &mut rng, depth))?;
                    let tokens = random_tokens(&mut rng, c.vocab_size, count);
                    let mut out = vec![0.0f32; c.vocab_size];
                    let secs = pool.install(|| -> Result<f64> {
                        let start = Instant::now();
                        if is_prompt {
                            model.prefill(&mut state, &tokens, &mut out)?;
                        } else {
                            for &t in &tokens {
                                model.decode(&mut state, t, &mut out)?;
                            }
                        }
                        Ok(start.elapsed().as_secs_f64())
                    })?;
                    if rep > 0 {
                        samples.push(count as f64 / secs);
                    }
                }
                let (mean, std) = mean_std(&samples);
                let (bytes, gbs) = if is_prompt {
                    (String::new(), String::new())
                } else {
                    let b = bytes_per_token(&model, depth + count / 2);
                    (format!("{:.3} GB", b / 1e9), format!("{:.1}", b * mean / 1e9))
                };
                println!(
                    "| {model_name} | {device} | {n_threads} | {name} | {depth} | {mean:.2} ± {std:.2} | {bytes} | {gbs} |"
                );
            }
        }
    }
    Ok(())
}

/// What `--batch` times: thread counts, depths, batch sizes, the context each sequence needs, steps and
/// repetitions.
struct Batched<'a> {
    threads: &'a [usize],
    depths: &'a [usize],
    batches: &'a [usize],
    max_context: usize,
    generate: usize,
    repetitions: usize,
}

/// `--batch`: for each thread count, depth and batch size, that many sequences filled to the depth by a prefill of
/// random tokens, then `generate` decode steps of all of them at once (`CpuModel::decode_rows`, the server's
/// batched step), timed `repetitions` times after one warm-up. Reports the step time and the tokens per second of
/// all rows together.
fn run_batched(model: &CpuModel, model_name: &str, device: &str, runs: Batched) -> Result<()> {
    let Batched {
        threads,
        depths,
        batches,
        max_context,
        generate,
        repetitions,
    } = runs;
    let c = model.config().clone();
    let mut rng = Rng::new(0xbe9c);
    println!(
        "| model | device | threads | test | depth (filled by prefill) | batch | step ms | t/s (all rows) |\n| --- | --- | ---: | --- | ---: | ---: | ---: | ---: |"
    );
    for &n_threads in threads {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(n_threads)
            .build()
            .context("starting the thread pool")?;
        for &depth in depths {
            for &batch in batches {
                let mut states: Vec<State> = (0..batch).map(|_| model.new_state(max_context)).collect();
                let mut outs = vec![vec![0.0f32; c.vocab_size]; batch];
                let mut samples = Vec::new();
                for rep in 0..=repetitions {
                    pool.install(|| -> Result<()> {
                        for (state, out) in states.iter_mut().zip(outs.iter_mut()) {
                            state.reset();
                            if depth > 0 {
                                model.prefill(state, &random_tokens(&mut rng, c.vocab_size, depth), out)?;
                            }
                        }
                        Ok(())
                    })?;
                    let tokens: Vec<Vec<u32>> = (0..generate)
                        .map(|_| random_tokens(&mut rng, c.vocab_size, batch))
                        .collect();
                    let secs = pool.install(|| -> Result<f64> {
                        let start = Instant::now();
                        for step in &tokens {
                            let mut rows: Vec<DecodeRow> = states
                                .iter_mut()
                                .zip(outs.iter_mut())
                                .zip(step)
                                .map(|((state, logits), &token)| DecodeRow { state, token, logits })
                                .collect();
                            model.decode_rows(&mut rows)?;
                        }
                        Ok(start.elapsed().as_secs_f64())
                    })?;
                    if rep > 0 {
                        samples.push(secs);
                    }
                }
                let steps: Vec<f64> = samples.iter().map(|s| s / generate as f64 * 1e3).collect();
                let rates: Vec<f64> = samples.iter().map(|s| (batch * generate) as f64 / s).collect();
                let ((step, step_std), (rate, rate_std)) = (mean_std(&steps), mean_std(&rates));
                println!(
                    "| {model_name} | {device} | {n_threads} | tg{generate} | {depth} | {batch} | {step:.2} ± {step_std:.2} | {rate:.2} ± {rate_std:.2} |"
                );
            }
        }
    }
    Ok(())
}
