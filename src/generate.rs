//! `lily generate`: one prompt in, its continuation and the prefill/decode speed out.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use lily_model::cpu::CpuModel;
use lily_model::sampling::{Sampler, SamplingParams};
use lily_model::{default_model, Weights};

#[derive(Args)]
pub struct ModelArgs {
    /// Model directory (MLX 4-bit or HF bf16 safetensors). Default: the bundled lily-tiny-shakespeare.
    #[arg(long, env = "LILY_MODEL")]
    pub model: Option<PathBuf>,
}

/// The sampling options of `generate` and `chat`. One left out takes the model directory's generation_config.json
/// value, as the server does; a model without that file is sampled greedily.
#[derive(Args)]
pub struct SamplingArgs {
    /// Sampling temperature; 0 is greedy.
    #[arg(long)]
    temperature: Option<f32>,
    /// Sample from the k most likely tokens only; 0 means no limit.
    #[arg(long)]
    top_k: Option<usize>,
    /// Sample from the most likely tokens that together reach this probability; 1 means no limit.
    #[arg(long)]
    top_p: Option<f32>,
    /// Drop tokens less likely than this fraction of the most likely one; 0 means no limit.
    #[arg(long)]
    min_p: Option<f32>,
    /// Sampling seed (default: a new one each run).
    #[arg(long)]
    seed: Option<u64>,
}

impl SamplingArgs {
    /// The checked parameters for the model in `dir`.
    pub fn params(&self, dir: &Path) -> Result<SamplingParams> {
        let base = if dir.join("generation_config.json").is_file() {
            let d = lily_server::params::GenerationDefaults::from_dir(dir);
            SamplingParams {
                temperature: d.temperature,
                top_k: d.top_k,
                top_p: d.top_p,
                min_p: d.min_p,
                seed: 0,
            }
        } else {
            SamplingParams::default()
        };
        let seed = self.seed.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |elapsed| elapsed.as_nanos() as u64)
        });
        let params = SamplingParams {
            temperature: self.temperature.unwrap_or(base.temperature),
            top_k: self.top_k.unwrap_or(base.top_k),
            top_p: self.top_p.unwrap_or(base.top_p),
            min_p: self.min_p.unwrap_or(base.min_p),
            seed,
        };
        params
            .validate()
            .map_err(|e| anyhow::anyhow!("--{}: {e}", e.param().replace('_', "-")))
    }
}

#[derive(Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[arg(long, default_value = "ROMEO.\n")]
    prompt: String,
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Maximum tokens of context (prompt + generated) to allocate state for.
    #[arg(long, default_value_t = 4096)]
    context: usize,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Where to run: CUDA where a GPU is usable (auto), or the one named.
    #[arg(long, value_enum, default_value = "auto")]
    device: crate::cuda_cmd::Device,
    #[command(flatten)]
    kernels: crate::cuda_cmd::KernelArgs,
    /// Treat --prompt as a user message: render it with the model's chat template and print only the answer on
    /// stdout (the reasoning goes to stderr).
    #[arg(long)]
    chat: bool,
    /// With --chat: turn thinking off (the template's enable_thinking=false).
    #[arg(long, requires = "chat", conflicts_with = "think")]
    no_think: bool,
    /// With --chat: turn thinking on (enable_thinking=true). Without --think or --no-think, the template's default.
    #[arg(long, requires = "chat")]
    think: bool,
    /// With --chat: a system prompt.
    #[arg(long, requires = "chat")]
    system: Option<String>,
    /// With --chat: drop the reasoning instead of printing it on stderr.
    #[arg(long, requires = "chat")]
    hide_reasoning: bool,
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
    args.kernels.apply();
    let dir = model_dir(&args.model)?;
    let params = args.sampling.params(&dir)?;
    if args.chat {
        return run_chat(&args, &dir, params);
    }
    let tokenizer = std::sync::Arc::new(lily_chat::Tokenizer::from_dir(&dir)?);
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
    let mut backend = crate::cuda_cmd::backend(args.device, &dir, args.context, || load_model(&dir))?;
    let mut sampler = Sampler::new(params);
    let eos = backend.config().eos_token_ids.clone();

    let prefill_secs = crate::chat::timed_prefill(backend.as_mut(), &prompt)?;

    let mut stdout = std::io::stdout().lock();
    let mut decoder = lily_chat::StreamDecoder::new(tokenizer.clone(), false);
    let decode_start = Instant::now();
    let mut generated = 0;
    let mut decode_steps = 0;
    loop {
        let token = backend.sample(&mut sampler)?;
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

/// `generate --chat`: one user message through the chat template; the answer on stdout, the reasoning on stderr.
fn run_chat(args: &GenerateArgs, dir: &Path, params: SamplingParams) -> Result<()> {
    let tokenizer = std::sync::Arc::new(lily_chat::Tokenizer::from_dir(dir)?);
    let template = lily_chat::ChatTemplate::from_dir(dir)?;
    let mut messages = Vec::new();
    if let Some(system) = &args.system {
        messages.push(serde_json::json!({"role": "system", "content": system}));
    }
    messages.push(serde_json::json!({"role": "user", "content": args.prompt}));
    let prompt_text = crate::chat::render_prompt(
        &template,
        messages,
        crate::chat::thinking_flag(args.think, args.no_think),
    )?;
    let prompt_tokens = tokenizer.encode(&prompt_text, false)?.len();
    if prompt_tokens + args.max_tokens > args.context {
        bail!(
            "prompt ({prompt_tokens} tokens) + --max-tokens ({}) exceeds --context ({})",
            args.max_tokens,
            args.context
        );
    }
    let mut backend = crate::cuda_cmd::backend(args.device, dir, args.context, || load_model(dir))?;
    let mut sampler = Sampler::new(params);
    let eos = if args.ignore_eos {
        Vec::new()
    } else {
        backend.config().eos_token_ids.clone()
    };

    let mut stdout = std::io::stdout().lock();
    let mut stderr = std::io::stderr().lock();
    let mut wrote_reasoning = false;
    let mut wrote_content = false;
    let mut show = |delta: lily_chat::Delta| -> Result<()> {
        match delta {
            lily_chat::Delta::Reasoning(text) if !args.hide_reasoning => {
                let text = if wrote_reasoning {
                    text.as_str()
                } else {
                    text.trim_start()
                };
                wrote_reasoning |= !text.is_empty();
                write!(stderr, "{text}")?;
                stderr.flush()?;
            }
            lily_chat::Delta::Content(text) => {
                let text = if wrote_content {
                    text.as_str()
                } else {
                    text.trim_start()
                };
                wrote_content |= !text.is_empty();
                write!(stdout, "{text}")?;
                stdout.flush()?;
            }
            _ => {}
        }
        Ok(())
    };
    let turn = crate::chat::generate_turn(
        backend.as_mut(),
        &mut sampler,
        &tokenizer,
        &prompt_text,
        lily_chat::OutputOptions {
            eos_token_ids: eos,
            max_tokens: Some(args.max_tokens),
            ..Default::default()
        },
        None,
        &mut show,
    )?;
    // Text held back until the end; an answer the model wrote in its think block comes here, as content.
    for delta in turn.output.deltas.iter().cloned() {
        show(delta)?;
    }
    if wrote_reasoning {
        writeln!(stderr)?;
    }
    writeln!(stdout)?;
    stdout.flush()?;
    eprintln!("{}", turn.stats_line());
    Ok(())
}
