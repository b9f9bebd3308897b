//! `lily generate`: one prompt in, its continuation and the prefill/decode speed out.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use lily_model::cpu::CpuModel;
use lily_model::sampling::{Sampler, SamplingParams};
use lily_model::{default_model, Backend, CpuBackend, Weights};

#[derive(Args)]
pub struct ModelArgs {
    /// Model directory (MLX 4-bit or HF bf16 safetensors). Default: the bundled lily-tiny-shakespeare.
    #[arg(long, env = "LILY_MODEL")]
    pub model: Option<PathBuf>,
}

#[derive(Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[arg(long, default_value = "ROMEO.\n")]
    prompt: String,
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Maximum tokens of context (prompt + generated) to allocate state for.
    #[arg(long, default_value_t = 4096)]
    context: usize,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    ignore_eos: bool,
}

pub fn model_dir(args: &ModelArgs) -> Result<PathBuf> {
    match &args.model {
        Some(dir) => Ok(dir.clone()),
        None => Ok(default_model::locate()?),
    }
}

pub fn load_model(dir: &Path) -> Result<CpuModel> {
    let start = Instant::now();
    let weights = Weights::load(dir).with_context(|| format!("loading {}", dir.display()))?;
    tracing::info!("loaded {} in {:.2} s", dir.display(), start.elapsed().as_secs_f64());
    Ok(CpuModel::new(weights))
}

pub fn run(args: GenerateArgs) -> Result<()> {
    let dir = model_dir(&args.model)?;
    let params = SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        seed: args.seed,
    };
    params.validate()?;
    let tokenizer = std::sync::Arc::new(lily_chat::Tokenizer::from_dir(&dir)?);
    let model = load_model(&dir)?;
    let prompt = tokenizer.encode(&args.prompt, false)?;
    if prompt.is_empty() {
        bail!("the prompt is empty");
    }
    if prompt.len() + args.max_tokens > args.context {
        bail!(
            "prompt ({} tokens) + --max-tokens ({}) exceeds --context ({})",
            prompt.len(),
            args.max_tokens,
            args.context
        );
    }
    let mut backend: Box<dyn Backend> = Box::new(CpuBackend::new(model, args.context));
    let mut sampler = Sampler::new(params);
    let eos = backend.config().eos_token_ids.clone();

    let prefill_start = Instant::now();
    backend.prefill(&prompt)?;
    let prefill_secs = prefill_start.elapsed().as_secs_f64();

    let mut stdout = std::io::stdout().lock();
    let mut decoder = lily_chat::StreamDecoder::new(tokenizer.clone(), false);
    let decode_start = Instant::now();
    let mut generated = 0;
    let mut decode_steps = 0;
    loop {
        let token = backend.sample(&mut sampler);
        generated += 1;
        if !args.ignore_eos && eos.contains(&token) {
            break;
        }
        write!(stdout, "{}", decoder.push(token)?)?;
        stdout.flush()?;
        if generated >= args.max_tokens {
            break;
        }
        backend.decode(token)?;
        decode_steps += 1;
    }
    writeln!(stdout, "{}", decoder.flush()?)?;
    let decode_secs = decode_start.elapsed().as_secs_f64();
    eprintln!(
        "prefill: {} tokens in {:.3} s ({:.1} tok/s); decode: {} tokens in {:.3} s ({:.1} tok/s)",
        prompt.len(),
        prefill_secs,
        prompt.len() as f64 / prefill_secs,
        decode_steps,
        decode_secs,
        decode_steps as f64 / decode_secs.max(1e-9)
    );
    Ok(())
}

