//! The CUDA side of the command line: the device choice of `generate` and `chat`, and the `selftest` and `bench`
//! commands over lily-cuda.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use lily_model::{Config, Weights};

use lily_cuda::batch::{fit_capacity, fit_snapshots, CudaBatchBackend};
use lily_cuda::bench::{self, DepthFill, Plan};
use lily_cuda::driver::{Gpu, GpuError};
use lily_cuda::model::Capacity;
use lily_cuda::weights::Source;
use lily_cuda::{CudaBackend, CudaModel};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Device {
    /// CUDA where a GPU is usable, else the CPU.
    #[default]
    Auto,
    Cpu,
    Cuda,
}

/// How the prefill's 8-bit attention (long calls on Hopper, README "The KV cache") takes the values and the
/// probabilities that weigh them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum AttentionValues {
    /// bf16 values and probabilities, as every other attention call.
    #[default]
    Bf16,
    /// e4m3 values (one scale per KV head) and probabilities: faster after long contexts, at a larger logit error
    /// (bench/RESULTS.md states both).
    E4m3,
}

/// The GPU kernels' options of a command.
#[derive(clap::Args, Clone, Copy, Debug, Default)]
pub struct KernelArgs {
    /// The number format of the values in the prefill's 8-bit attention on Hopper GPUs (sm_90a) [default: bf16].
    /// Given, it replaces what LILY_KERNEL_DEFINES says of ATTN_I8_V8 (e4m3 is ATTN_I8_V8=1).
    #[arg(long, value_enum)]
    pub attention_values: Option<AttentionValues>,
}

impl KernelArgs {
    /// Sets the kernels' switches that were given; before the first kernel is compiled.
    pub fn apply(&self) {
        if let Some(values) = self.attention_values {
            let v8 = match values {
                AttentionValues::Bf16 => "0",
                AttentionValues::E4m3 => "1",
            };
            lily_cuda::kernels::set_switch("ATTN_I8_V8", v8);
            tracing::info!("the prefill's 8-bit attention takes {values:?} values (--attention-values)");
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Shape {
    Tiny,
    Full,
}

impl Shape {
    fn config(self) -> Config {
        match self {
            Shape::Tiny => Config::tiny_shape(),
            Shape::Full => Config::full_shape(),
        }
    }

    /// The shape's configuration, cut to its first `layers` layers when given (`lily bench --layers`).
    pub fn config_with_layers(self, layers: Option<usize>) -> Result<Config> {
        let mut config = self.config();
        if let Some(layers) = layers {
            if layers == 0 || layers > config.num_hidden_layers {
                bail!("--layers must be 1..={}", config.num_hidden_layers);
            }
            config.num_hidden_layers = layers;
            config.layer_types.truncate(layers);
        }
        Ok(config)
    }
}

fn progress_bar(message: String) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(0).with_style(
        indicatif::ProgressStyle::with_template("{msg} [{bar:40}] {bytes}/{total_bytes} ({elapsed})")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_message(message);
    bar
}

/// Loads the model for one sequence, or with `capacity` (slots and KV pages) for the batched backend.
fn load(
    gpu: Gpu,
    config: Config,
    source: &Source,
    max_context: usize,
    capacity: Option<Capacity>,
    what: &str,
) -> Result<CudaModel> {
    let bar = progress_bar(format!("loading {what} onto {}", gpu.name));
    let progress = |done: usize, total: usize| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    };
    let model = match capacity {
        None => CudaModel::single(gpu, config, source, max_context, &progress)?,
        Some(capacity) => CudaModel::new(gpu, config, source, max_context, capacity, &progress)?,
    };
    bar.finish_and_clear();
    Ok(model)
}

/// The GPU `device` asks for, or `None` where the CPU should run (`--device cpu`, or `auto` with no usable GPU;
/// the reason is logged).
fn open_gpu(device: Device) -> Result<Option<Gpu>> {
    if device == Device::Cpu {
        return Ok(None);
    }
    match Gpu::open() {
        Ok(gpu) => Ok(Some(gpu)),
        Err(e @ (GpuError::NoDriver | GpuError::NoDevice)) if device == Device::Auto => {
            tracing::info!("running on the CPU: {e}");
            Ok(None)
        }
        Err(e) => Err(e.into()),
    }
}

/// The CUDA backend for `generate` with the model in `dir`, or `None` where the CPU should run it.
pub fn open_backend(device: Device, dir: &Path, max_context: usize) -> Result<Option<CudaBackend>> {
    let Some(gpu) = open_gpu(device)? else {
        return Ok(None);
    };
    let weights = Weights::load(dir).with_context(|| format!("loading {}", dir.display()))?;
    let config = weights.config.clone();
    let what = dir.display().to_string();
    let model = load(gpu, config, &Source::Cpu(&weights), max_context, None, &what)?;
    Ok(Some(CudaBackend::new(model)))
}

/// Share of the GPU memory left after the weights, the slots' state and the scratch that the KV pool takes when
/// `--kv-tokens` does not size it.
const KV_FRACTION: f64 = 0.9;

/// The batched CUDA backend for `serve` with the model in `dir`: `max_seqs` slots of up to `max_context` tokens,
/// snapshot buffers for `prefix_cache_bytes` (`None`: the share [`fit_snapshots`] gives them), a KV pool of
/// `kv_tokens` positions (rounded up to whole pages) or else of [`KV_FRACTION`] of the GPU memory left. `None`
/// where the CPU should run it.
pub fn open_batch_backend(
    device: Device,
    dir: &Path,
    max_context: usize,
    max_seqs: usize,
    kv_tokens: Option<usize>,
    prefix_cache_bytes: Option<usize>,
) -> Result<Option<CudaBatchBackend>> {
    let Some(gpu) = open_gpu(device)? else {
        return Ok(None);
    };
    let weights = Weights::load(dir).with_context(|| format!("loading {}", dir.display()))?;
    let config = weights.config.clone();
    let weight_bytes = lily_cuda::weights::device_bytes(&weights);
    let capacity = match kv_tokens {
        Some(tokens) => Capacity {
            max_seqs,
            kv_pages: lily_cuda::pages::pages_for(tokens.max(1)),
            snapshots: fit_snapshots(&gpu, &config, weight_bytes, prefix_cache_bytes)?,
        },
        None => fit_capacity(
            &gpu,
            &config,
            weight_bytes,
            max_seqs,
            max_context,
            KV_FRACTION,
            prefix_cache_bytes,
        )?,
    };
    let what = dir.display().to_string();
    let model = load(gpu, config, &Source::Cpu(&weights), max_context, Some(capacity), &what)?;
    tracing::info!(
        "GPU memory: {} slots ({:.1} GB of DeltaNet state), {} snapshot buffers ({:.1} GB), {} KV pages of {} tokens ({} tokens, {:.1} GB); {:.1} GB free after loading",
        capacity.max_seqs,
        (model.state.recurrent.iter().map(|b| b.bytes()).sum::<usize>() + model.state.conv_ring.iter().map(|b| b.bytes()).sum::<usize>()) as f64 / 1e9,
        capacity.snapshots,
        (model.state.snapshot_recurrent.iter().map(|b| b.bytes()).sum::<usize>() + model.state.snapshot_ring.iter().map(|b| b.bytes()).sum::<usize>()) as f64 / 1e9,
        capacity.kv_pages,
        lily_cuda::pages::KV_PAGE,
        capacity.kv_pages * lily_cuda::pages::KV_PAGE,
        (model.state.k_pool.iter().chain(&model.state.v_pool).map(|b| b.bytes()).sum::<usize>()) as f64 / 1e9,
        model.gpu.free_memory()? as f64 / 1e9
    );
    Ok(Some(CudaBatchBackend::new(model)?))
}

/// The backend `--device` asks for: CUDA (`cuda`, or `auto` where a GPU is usable), else the CPU model that
/// `load_cpu` loads.
pub fn backend(
    device: Device,
    dir: &Path,
    max_context: usize,
    load_cpu: impl FnOnce() -> Result<lily_model::cpu::CpuModel>,
) -> Result<Box<dyn lily_model::Backend>> {
    match open_backend(device, dir, max_context)? {
        Some(cuda) => Ok(Box::new(cuda)),
        None => Ok(Box::new(lily_model::CpuBackend::new(load_cpu()?, max_context))),
    }
}

#[derive(clap::Args)]
pub struct SelftestArgs {
    /// Only compile every kernel with NVRTC for sm_90a at both shapes (no GPU needed); fails if one does not.
    #[arg(long)]
    pub compile_only: bool,
    /// With --compile-only, also write each file's sm_90a code to DIR/<shape>/<file>.cubin (for a disassembler
    /// such as nvdisasm).
    #[arg(long, value_name = "DIR", requires = "compile_only")]
    pub dump: Option<PathBuf>,
    /// Also compare GPU and CPU logits at the full shape (builds the 19.5 GB synthetic checkpoint on both).
    #[arg(long)]
    pub full_shape: bool,
    /// Directory of the transformers golden files (scripts/golden.py) to compare the GPU with.
    #[arg(long, default_value = "crates/lily-model/tests/golden")]
    pub golden: PathBuf,
    /// Seed of the random inputs and weights (by default a new one each run, printed first): repeats a run.
    #[arg(long)]
    pub seed: Option<u64>,
    #[command(flatten)]
    pub kernels: KernelArgs,
}

pub fn selftest(args: SelftestArgs) -> Result<()> {
    args.kernels.apply();
    if args.compile_only {
        if !lily_cuda::kernels::nvrtc_available() {
            bail!("libnvrtc not found: pip install nvidia-cuda-nvrtc==13.0.88 and put its nvidia/cu13/lib on LD_LIBRARY_PATH");
        }
        for (shape, config) in [("full", Config::full_shape()), ("tiny", Config::tiny_shape())] {
            let dir = args.dump.as_ref().map(|d| d.join(shape));
            if let Some(dir) = &dir {
                std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
            }
            for (name, image, log) in lily_cuda::kernels::compile_all(&config, "sm_90a", false)? {
                println!(
                    "ok   {name:<14} hidden {:<5} {} bytes of sm_90a code",
                    config.hidden_size,
                    image.len()
                );
                if !log.trim().is_empty() {
                    println!("{log}");
                }
                if let Some(dir) = &dir {
                    let path = dir.join(format!("{name}.cubin"));
                    std::fs::write(&path, &image).with_context(|| format!("writing {}", path.display()))?;
                }
            }
        }
        return Ok(());
    }
    let failures = lily_cuda::selftest::run_all(&lily_cuda::selftest::Options {
        full_shape: args.full_shape,
        golden: args.golden,
        seed: args.seed,
    })?;
    if failures > 0 {
        bail!("{failures} selftest check(s) failed");
    }
    Ok(())
}

/// How `lily bench` fills the context before the timed part.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Fill {
    /// Random keys, values and recurrent state written directly.
    Random,
    /// A real prefill of random tokens.
    Prefill,
}

/// A comma-separated list of sizes (an option may also be repeated).
#[derive(Clone, Debug)]
pub struct List(pub Vec<usize>);

fn parse_list(s: &str) -> std::result::Result<List, String> {
    s.split(',')
        .filter(|p| !p.is_empty())
        .map(|p| p.trim().parse::<usize>().map_err(|e| format!("`{p}`: {e}")))
        .collect::<std::result::Result<_, _>>()
        .map(List)
}

#[derive(clap::Args)]
pub struct BenchArgs {
    /// Where to run: the GPU (`cuda`, the default) or the CPU backend (`cpu`: depths are filled by prefill).
    #[arg(long, value_enum, default_value = "cuda")]
    pub device: Device,
    #[command(flatten)]
    pub kernels: KernelArgs,
    /// CPU only: thread counts to time (comma-separated; default: one thread per core).
    #[arg(short = 't', long = "threads", value_parser = parse_list, default_value = "")]
    pub threads: Vec<List>,
    /// Weights generated at this shape (on the GPU, or in memory for the CPU; no checkpoint needed).
    #[arg(long, value_enum, conflicts_with = "model")]
    pub synthetic: Option<Shape>,
    /// With --synthetic: keep only the first N layers of the shape (every matrix keeps its size).
    #[arg(long, requires = "synthetic")]
    pub layers: Option<usize>,
    /// Model directory (MLX 4-bit or HF bf16). Default: the bundled lily-tiny-shakespeare.
    #[arg(long, env = "LILY_MODEL")]
    pub model: Option<PathBuf>,
    /// Prompt sizes to time (comma-separated; empty for none).
    #[arg(short = 'p', long = "n-prompt", value_parser = parse_list, default_value = "")]
    pub prompts: Vec<List>,
    /// Tokens to generate in the decode test.
    #[arg(short = 'n', long = "n-gen", default_value_t = 128)]
    pub generate: usize,
    /// Context depths (comma-separated).
    #[arg(short = 'd', long = "n-depth", value_parser = parse_list, default_value = "0")]
    pub depths: Vec<List>,
    /// Timed repetitions (after one warm-up).
    #[arg(short = 'r', long = "repetitions", default_value_t = 5)]
    pub repetitions: usize,
    /// How the context is filled before the timed part.
    #[arg(long, value_enum, default_value = "random")]
    pub fill: Fill,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Also print the per-kernel GPU time of one step at each depth (CUDA events).
    #[arg(long)]
    pub profile: bool,
    /// Also time each kernel inside the captured decode step and inside one prefill of each prompt size at each
    /// depth (kernels compiled with a clock probe after each one's wait for the previous kernel; the timed tests
    /// then run those kernels too).
    #[arg(long)]
    pub timeline: bool,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Time the batched decode step of the server's engine instead, with this many sequences at once
    /// (comma-separated): each depth's context is a real prefill in every slot, `-n` steps of all rows are timed.
    /// With `-p`, the prefill of this many prompts of each size instead: one a call, then joined into passes.
    #[arg(long, value_parser = parse_list)]
    pub batch: Vec<List>,
    /// With --batch: steps of fewer rows than this run row by row through the single-sequence decode graphs (the
    /// server's engine does so below lily_cuda::batch::SEQUENTIAL_BELOW rows); 0 times the batched step at every
    /// row count.
    #[arg(long)]
    pub sequential_below: Option<usize>,
}

pub fn bench(args: BenchArgs) -> Result<()> {
    args.kernels.apply();
    match args.device {
        Device::Cpu => return crate::cpu_bench::run(args),
        Device::Auto => bail!("lily bench needs --device cuda or --device cpu"),
        Device::Cuda => {}
    }
    let prompts: Vec<usize> = args.prompts.into_iter().flat_map(|l| l.0).collect();
    let depths: Vec<usize> = args.depths.into_iter().flat_map(|l| l.0).collect();
    if depths.is_empty() || args.repetitions == 0 {
        bail!("give at least one depth and one repetition");
    }
    let batches: Vec<usize> = args.batch.into_iter().flat_map(|l| l.0).collect();
    let longest = prompts.iter().copied().max().unwrap_or(0).max(args.generate);
    let mut max_context = depths.iter().max().copied().unwrap_or(0).max(1)
        + longest * (1 + if batches.is_empty() { 0 } else { args.repetitions })
        + 1;
    if !batches.is_empty() && !prompts.is_empty() {
        // The prefill chunk is capped by the context: give the joined passes the server's budget.
        max_context = max_context.max(lily_cuda::batch::PREFILL_BUDGET);
    }
    if args.timeline {
        lily_cuda::kernels::enable_timeline();
    }
    let capacity = batches.iter().max().map(|&max_seqs| Capacity {
        max_seqs,
        kv_pages: max_seqs * lily_cuda::pages::pages_for(max_context),
        snapshots: 0,
    });
    let gpu = Gpu::open()?;
    let (model, model_name) = match args.synthetic {
        Some(shape) => {
            let config = shape.config_with_layers(args.layers)?;
            let name = format!(
                "synthetic {shape:?}, {} layers (4-bit, seed {})",
                config.num_hidden_layers, args.seed
            )
            .to_lowercase();
            (
                load(
                    gpu,
                    config.clone(),
                    &Source::synthetic(&config, args.seed),
                    max_context,
                    capacity,
                    &name,
                )?,
                name,
            )
        }
        None => {
            let dir = match args.model {
                Some(dir) => dir,
                None => lily_model::default_model::locate()?,
            };
            let weights = Weights::load(&dir).with_context(|| format!("loading {}", dir.display()))?;
            let config = weights.config.clone();
            let name = dir
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            (
                load(gpu, config, &Source::Cpu(&weights), max_context, capacity, &name)?,
                name,
            )
        }
    };
    if max_context > model.config.max_position_embeddings {
        bail!(
            "depth + tokens ({max_context}) exceeds the model's {} positions",
            model.config.max_position_embeddings
        );
    }
    let device = model.gpu.name.clone();
    if !batches.is_empty() {
        println!("model: {model_name}; batched step");
        let mut backend = lily_cuda::batch::CudaBatchBackend::new(model)?;
        if let Some(below) = args.sequential_below {
            backend.sequential_below = below;
        }
        let (n, r) = (args.generate, args.repetitions);
        if !prompts.is_empty() {
            return Ok(bench::batched::run_prefill(&mut backend, &batches, &prompts, r)?);
        }
        return Ok(bench::batched::run(
            &mut backend,
            &batches,
            &depths,
            n,
            r,
            args.profile,
        )?);
    }
    let mut backend = CudaBackend::new(model);
    let plan = Plan {
        model_name,
        prompts,
        generate: args.generate,
        depths,
        repetitions: args.repetitions,
        fill: match args.fill {
            Fill::Random => DepthFill::Random,
            Fill::Prefill => DepthFill::Prefill,
        },
        profile: args.profile,
        timeline: args.timeline,
    };
    let rows = bench::run(&mut backend, &plan)?;
    if let Some(path) = args.json {
        std::fs::write(
            &path,
            serde_json::to_string_pretty(&bench::to_json(&plan, &device, &rows))?,
        )
        .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
