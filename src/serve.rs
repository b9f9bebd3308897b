//! `lily serve`: the server's arguments plus the device, which only the binary can choose (the server crate does
//! not depend on the CUDA backend).

use std::path::PathBuf;

use crate::cuda_cmd::{Device, KernelArgs};
use anyhow::Result;
use clap::Args;
use lily_server::BackendFactory;

#[derive(Args)]
pub struct ServeCmd {
    #[command(flatten)]
    serve: lily_server::ServeArgs,
    /// Where to run: CUDA where a GPU is usable (auto), or the one named. The choice is logged at start-up and
    /// shown by GET /health.
    #[arg(long, value_enum, default_value = "auto")]
    device: Device,
    #[command(flatten)]
    kernels: KernelArgs,
}

pub fn run(args: ServeCmd) -> Result<()> {
    args.kernels.apply();
    let device = args.device;
    lily_server::run(args.serve, move |dir| backend_factory(device, dir))
}

/// The backend `--device` asks for, built on the engine thread: CUDA's batched backend (`cuda`, or `auto` where a
/// GPU is usable), else the CPU's.
fn backend_factory(device: Device, dir: PathBuf) -> BackendFactory {
    Box::new(move |context, pool: &lily_server::PoolOptions| {
        let max_seqs = pool.max_seqs.unwrap_or(DEFAULT_CUDA_MAX_SEQS);
        anyhow::ensure!(max_seqs >= 1, "--max-seqs must be at least 1");
        match crate::cuda_cmd::open_batch_backend(
            device,
            &dir,
            context,
            max_seqs,
            pool.kv_tokens,
            pool.prefix_cache_bytes,
        )? {
            Some(cuda) => Ok(Box::new(cuda) as Box<dyn lily_model::BatchBackend>),
            None => {
                if device == Device::Auto {
                    eprintln!("lily serve: no usable GPU (see LILY_LOG=info for why): running on the CPU");
                }
                lily_server::cpu_backend_factory(dir)(context, pool)
            }
        }
    })
}

/// Sequences a GPU serves at once unless `--max-seqs` says otherwise: each holds ~35 MB of DeltaNet state at the
/// full shape (9 GB for 256), and the aggregate rate still grows up to this many.
const DEFAULT_CUDA_MAX_SEQS: usize = 256;
