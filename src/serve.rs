//! `lily serve`: the server's arguments plus the device, which only the binary can choose (the server crate does
//! not depend on the CUDA backend).

use std::path::PathBuf;

use crate::cuda_cmd::Device;
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
}

pub fn run(args: ServeCmd) -> Result<()> {
    let device = args.device;
    lily_server::run(args.serve, move |dir| backend_factory(device, dir))
}

/// The backend `--device` asks for, built on the engine thread: CUDA (`cuda`, or `auto` where a GPU is usable),
/// else the CPU's batch backend.
fn backend_factory(device: Device, dir: PathBuf) -> BackendFactory {
    Box::new(move |context, pool: &lily_server::PoolOptions| {
        match crate::cuda_cmd::open_backend(device, &dir, context)? {
            Some(cuda) => cuda_batch_backend(cuda, pool),
            None => {
                if device == Device::Auto {
                    eprintln!("lily serve: no usable GPU (see LILY_LOG=info for why): running on the CPU");
                }
                lily_server::cpu_backend_factory(dir)(context, pool)
            }
        }
    })
}

/// The GPU's batch backend. The single-sequence `CudaBackend` serves through a one-slot adapter; a batched CUDA
/// backend, sized by `pool` (`--max-seqs`, `--kv-tokens`), is built here instead once it exists.
fn cuda_batch_backend(
    cuda: lily_cuda::CudaBackend,
    pool: &lily_server::PoolOptions,
) -> Result<Box<dyn lily_model::BatchBackend>> {
    if pool.max_seqs.is_some_and(|n| n > 1) || pool.kv_tokens.is_some() {
        eprintln!(
            "lily serve: the GPU backend runs one sequence at a time for now: --max-seqs and --kv-tokens are ignored"
        );
    }
    Ok(Box::new(lily_model::SingleSlot::new(Box::new(cuda))))
}
