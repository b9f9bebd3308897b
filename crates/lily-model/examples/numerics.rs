//! Logit error of reduced-precision operand formats, emulated on the CPU (`lily_model::cpu::numerics`), for choosing
//! the formats of GPU prompt-path kernels before writing them.
//!
//! `cargo run --release -p lily-model --example numerics -- [--model DIR] [--long TOKENS] [--seed S] [--only TEXT]...`
//!
//! On the bundled model (or DIR), runs the prompts of the golden file (`tests/golden/lily-tiny-shakespeare`, the
//! prompts transformers' logits were taken on) and one longer text the model samples itself (`--long`, default
//! 2,048 tokens, temperature 1, after the first golden prompt) through the prompt path once in f32 and once per format, and prints
//! for each format how far its logits at every position are from the f32 ones: the largest absolute difference,
//! the mean and largest KL divergence of its next-token distribution from f32's, and how often the most likely
//! token is the same. `--only TEXT` (repeatable) keeps the formats whose name contains one of the texts.

use std::path::PathBuf;

use lily_model::cpu::numerics::{self, AttentionRounding, Operand, Rounding};
use lily_model::cpu::CpuModel;
use lily_model::sampling::{argmax, Sampler, SamplingParams};
use lily_model::{default_model, Weights};
use rayon::prelude::*;
use safetensors::SafeTensors;

/// Tokens a prompt is run in at a time, so that only this many rows of logits are held per format.
const PIECE: usize = 256;

struct Format {
    name: &'static str,
    products: Rounding,
    attention: AttentionRounding,
}

/// The attention's operands: q and k in `scores`, v and the probabilities in `values`.
const fn attention(scores: Operand, values: Operand, rotated: bool) -> AttentionRounding {
    AttentionRounding::Rounded {
        scores,
        values,
        rotated,
    }
}

const FORMATS: &[Format] = &[
    Format {
        name: "bf16 products, bf16 attention (the GPU prompt path today)",
        products: Rounding::Bf16,
        attention: AttentionRounding::BF16,
    },
    Format {
        name: "int8x2/64 products (the batched step's codes), bf16 attention",
        products: Rounding::Int8x2 { group: 64 },
        attention: AttentionRounding::BF16,
    },
    Format {
        name: "int8/64 products, bf16 attention",
        products: Rounding::Int8 { group: 64 },
        attention: AttentionRounding::BF16,
    },
    Format {
        name: "e4m3/128 products, bf16 attention",
        products: Rounding::E4m3 { group: 128 },
        attention: AttentionRounding::BF16,
    },
    Format {
        name: "e4m3/row products, bf16 attention",
        products: Rounding::E4m3 { group: 0 },
        attention: AttentionRounding::BF16,
    },
    Format {
        name: "bf16 products, e4m3 attention",
        products: Rounding::Bf16,
        attention: attention(Operand::E4m3, Operand::E4m3, false),
    },
    Format {
        name: "bf16 products, e4m3 attention, q and k rotated",
        products: Rounding::Bf16,
        attention: attention(Operand::E4m3, Operand::E4m3, true),
    },
    Format {
        name: "bf16 products, e4m3 scores (q, k rotated), bf16 values",
        products: Rounding::Bf16,
        attention: attention(Operand::E4m3, Operand::Bf16, true),
    },
    Format {
        name: "bf16 products, bf16 scores, e4m3 values (v, probabilities)",
        products: Rounding::Bf16,
        attention: attention(Operand::Bf16, Operand::E4m3, false),
    },
    Format {
        name: "bf16 products, int8 attention (k smoothed; probabilities per block of 64)",
        products: Rounding::Bf16,
        attention: attention(Operand::Int8, Operand::Int8, false),
    },
    Format {
        name: "bf16 products, int8 scores (k smoothed), bf16 values",
        products: Rounding::Bf16,
        attention: attention(Operand::Int8, Operand::Bf16, false),
    },
    Format {
        name: "bf16 products, bf16 scores, int8 values (probabilities per block of 64)",
        products: Rounding::Bf16,
        attention: attention(Operand::Bf16, Operand::Int8, false),
    },
    Format {
        name: "bf16 products, int8 scores (k smoothed), e4m3 values",
        products: Rounding::Bf16,
        attention: attention(Operand::Int8, Operand::E4m3, false),
    },
    Format {
        name: "bf16 products, bf16 scores, e4m3 values (probabilities scaled per block of 64)",
        products: Rounding::Bf16,
        attention: attention(Operand::Bf16, Operand::E4m3Scaled, false),
    },
    Format {
        name: "bf16 products, int8 scores (k smoothed), e4m3 values (probabilities scaled per block of 64)",
        products: Rounding::Bf16,
        attention: attention(Operand::Int8, Operand::E4m3Scaled, false),
    },
];

#[derive(Default, Clone)]
struct Errors {
    positions: usize,
    max_abs: f32,
    sum_kl: f64,
    max_kl: f64,
    top1_same: usize,
}

impl Errors {
    fn add(&mut self, other: &Errors) {
        self.positions += other.positions;
        self.max_abs = self.max_abs.max(other.max_abs);
        self.sum_kl += other.sum_kl;
        self.max_kl = self.max_kl.max(other.max_kl);
        self.top1_same += other.top1_same;
    }
}

/// log-softmax of a row, in f64.
fn log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
    let log_sum = sum.ln() + max;
    row.iter().map(|&x| x as f64 - log_sum).collect()
}

/// Compares rows of logits (`[positions][vocab]`) with the reference rows.
fn compare(reference: &[f32], got: &[f32], vocab: usize) -> Errors {
    reference
        .par_chunks(vocab)
        .zip(got.par_chunks(vocab))
        .map(|(r, g)| {
            let (lr, lg) = (log_softmax(r), log_softmax(g));
            let kl: f64 = lr.iter().zip(&lg).map(|(a, b)| a.exp() * (a - b)).sum();
            Errors {
                positions: 1,
                max_abs: r.iter().zip(g).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max),
                sum_kl: kl,
                max_kl: kl,
                top1_same: (argmax(r) == argmax(g)) as usize,
            }
        })
        .reduce(Errors::default, |mut a, b| {
            a.add(&b);
            a
        })
}

/// Runs `tokens` through the f32 path and through every format, `PIECE` tokens at a time; returns each piece's
/// errors of each format (`[piece][format]`).
fn measure(model: &CpuModel, formats: &[&Format], tokens: &[u32]) -> Vec<Vec<Errors>> {
    let vocab = model.config().vocab_size;
    let mut reference_state = model.new_state(tokens.len());
    let mut states: Vec<_> = formats.iter().map(|_| model.new_state(tokens.len())).collect();
    let mut pieces = Vec::new();
    for piece in tokens.chunks(PIECE) {
        numerics::set_products(Rounding::Exact);
        numerics::set_attention(AttentionRounding::Exact);
        let reference = model.prefill_all_logits(&mut reference_state, piece).unwrap();
        let mut errors = Vec::new();
        for (format, state) in formats.iter().zip(&mut states) {
            numerics::set_products(format.products);
            numerics::set_attention(format.attention);
            let got = model.prefill_all_logits(state, piece).unwrap();
            errors.push(compare(&reference, &got, vocab));
        }
        pieces.push(errors);
    }
    numerics::set_products(Rounding::Exact);
    numerics::set_attention(AttentionRounding::Exact);
    pieces
}

/// Each format's errors over the given pieces.
fn total<'a>(pieces: impl IntoIterator<Item = &'a Vec<Errors>>) -> Vec<Errors> {
    let mut total = Vec::<Errors>::new();
    for piece in pieces {
        total.resize(piece.len(), Errors::default());
        for (t, e) in total.iter_mut().zip(piece) {
            t.add(e);
        }
    }
    total
}

/// A text the model writes itself: `len` tokens sampled at temperature 1 after `prompt`, prompt included.
fn sampled_text(model: &CpuModel, prompt: &[u32], len: usize, seed: u64) -> Vec<u32> {
    let vocab = model.config().vocab_size;
    let mut state = model.new_state(len + 1);
    let mut logits = vec![0.0; vocab];
    model.prefill(&mut state, prompt, &mut logits).unwrap();
    let params = SamplingParams {
        temperature: 1.0,
        seed,
        ..SamplingParams::default()
    };
    let mut sampler = Sampler::new(params.validate().unwrap());
    let mut tokens = prompt.to_vec();
    while tokens.len() < len {
        let next = sampler.sample(&logits);
        tokens.push(next);
        model.decode(&mut state, next, &mut logits).unwrap();
    }
    tokens
}

fn golden_prompts() -> Vec<Vec<u32>> {
    let path = format!(
        "{}/tests/golden/lily-tiny-shakespeare.safetensors",
        env!("CARGO_MANIFEST_DIR")
    );
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let st = SafeTensors::deserialize(&bytes).unwrap();
    (0..)
        .map_while(|p| st.tensor(&format!("p{p}.tokens")).ok())
        .map(|t| {
            t.data()
                .chunks_exact(4)
                .map(|c| i32::from_le_bytes(c.try_into().unwrap()) as u32)
                .collect()
        })
        .collect()
}

fn print(title: &str, formats: &[&Format], errors: &[Errors]) {
    println!("\n{title}\n");
    println!("| format | positions | max abs logit error | mean KL (nats) | max KL (nats) | same top-1 |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: |");
    for (format, e) in formats.iter().zip(errors) {
        println!(
            "| {} | {} | {:.4} | {:.2e} | {:.2e} | {:.2}% |",
            format.name,
            e.positions,
            e.max_abs,
            e.sum_kl / e.positions as f64,
            e.max_kl,
            100.0 * e.top1_same as f64 / e.positions as f64
        );
    }
}

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let (mut dir, mut long, mut seed, mut only) = (None, 2048usize, 1u64, Vec::new());
    while let Some(arg) = args.next() {
        let mut value = || args.next().ok_or_else(|| anyhow::anyhow!("{arg} needs a value"));
        match arg.as_str() {
            "--model" => dir = Some(PathBuf::from(value()?)),
            "--long" => long = value()?.parse()?,
            "--seed" => seed = value()?.parse()?,
            "--only" => only.push(value()?),
            _ => anyhow::bail!("unknown argument {arg}"),
        }
    }
    let dir = match dir {
        Some(dir) => dir,
        None => default_model::locate()?,
    };
    let model = CpuModel::new(Weights::load(&dir)?);
    let formats: Vec<&Format> = FORMATS
        .iter()
        .filter(|f| only.is_empty() || only.iter().any(|o| f.name.contains(o.as_str())))
        .collect();
    anyhow::ensure!(!formats.is_empty(), "no format's name contains any of {only:?}");

    let prompts = golden_prompts();
    let golden: Vec<Vec<Errors>> = prompts.iter().flat_map(|p| measure(&model, &formats, p)).collect();
    let golden = total(&golden);
    let lengths: Vec<usize> = prompts.iter().map(Vec::len).collect();
    print(
        &format!(
            "The golden prompts ({} prompts of {lengths:?} tokens), against f32:",
            prompts.len()
        ),
        &formats,
        &golden,
    );

    if long > 0 {
        let text = sampled_text(&model, &prompts[0], long, seed);
        let pieces = measure(&model, &formats, &text);
        print(
            &format!("A text of {long} tokens the model sampled after the first golden prompt (temperature 1, seed {seed}), against f32:"),
            &formats,
            &total(&pieces),
        );
        // By depth: positions in [2^i * PIECE, 2^(i + 1) * PIECE), the first bucket from 0.
        let mut buckets = vec![(0, 1)];
        while buckets.last().unwrap().1 < pieces.len() {
            let end = buckets.last().unwrap().1;
            buckets.push((end, (2 * end).min(pieces.len())));
        }
        println!("\nMean KL (nats) of the same text by position:\n");
        let header: Vec<String> = buckets
            .iter()
            .map(|(a, b)| format!("{}-{}", a * PIECE, (b * PIECE).min(text.len()) - 1))
            .collect();
        println!("| format | {} |", header.join(" | "));
        println!("| --- |{}", " ---: |".repeat(buckets.len()));
        let by_bucket: Vec<Vec<Errors>> = buckets.iter().map(|&(a, b)| total(&pieces[a..b])).collect();
        for (f, format) in formats.iter().enumerate() {
            let cells: Vec<String> = by_bucket
                .iter()
                .map(|e| format!("{:.2e}", e[f].sum_kl / e[f].positions as f64))
                .collect();
            println!("| {} | {} |", format.name, cells.join(" | "));
        }
    }
    Ok(())
}
