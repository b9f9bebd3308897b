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
/// else the CPU.
fn backend_factory(device: Device, dir: PathBuf) -> BackendFactory {
    Box::new(
        move |context| match crate::cuda_cmd::open_backend(device, &dir, context)? {
            Some(cuda) => Ok(Box::new(cuda) as Box<dyn lily_model::Backend>),
            None => {
                if device == Device::Auto {
                    eprintln!("lily serve: no usable GPU (see LILY_LOG=info for why): running on the CPU");
                }
                lily_server::cpu_backend_factory(dir)(context)
            }
        },
    )
}
