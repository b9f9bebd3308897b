//! `lily synth`: write a synthetic checkpoint.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Result;
use clap::{Args, ValueEnum};
use lily_model::{synth, Config};

#[derive(Clone, Copy, ValueEnum)]
pub enum Shape {
    Tiny,
    Full,
}

/// The checkpoint layout to write: lily's synthetic MLX 4-bit (random packed weights, sharded), or one of the
/// published releases' layouts (weights on the 4-bit grid, so every layout holds the same model).
#[derive(Clone, Copy, ValueEnum)]
pub enum LayoutArg {
    Synthetic,
    HfRelease,
    HfPerExpert,
    MlxLm,
    MlxVlm,
    MlxBf16,
}

#[derive(Args)]
pub struct SynthArgs {
    #[arg(long, value_enum)]
    shape: Shape,
    #[arg(long, value_enum, default_value = "synthetic")]
    layout: LayoutArg,
    #[arg(long)]
    out: PathBuf,
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

pub fn run(args: SynthArgs) -> Result<()> {
    let config = match args.shape {
        Shape::Tiny => Config::tiny_shape(),
        Shape::Full => Config::full_shape(),
    };
    let start = Instant::now();
    let published = match args.layout {
        LayoutArg::Synthetic => None,
        LayoutArg::HfRelease => Some(synth::Published::HfRelease),
        LayoutArg::HfPerExpert => Some(synth::Published::HfPerExpert),
        LayoutArg::MlxLm => Some(synth::Published::MlxLm),
        LayoutArg::MlxVlm => Some(synth::Published::MlxVlm),
        LayoutArg::MlxBf16 => Some(synth::Published::MlxBf16),
    };
    if let Some(layout) = published {
        synth::write_published(&config, args.seed, layout, &args.out)?;
        eprintln!("wrote {} in {:.1} s", args.out.display(), start.elapsed().as_secs_f64());
        return Ok(());
    }
    let bar = indicatif::ProgressBar::new(0).with_style(
        indicatif::ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} shards")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_message(format!("writing {:.2} GB", synth::total_bytes(&config) as f64 / 1e9));
    synth::write_dir(&config, args.seed, &args.out, &|done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    })?;
    bar.finish();
    eprintln!("wrote {} in {:.1} s", args.out.display(), start.elapsed().as_secs_f64());
    Ok(())
}
