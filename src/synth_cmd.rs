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

#[derive(Args)]
pub struct SynthArgs {
    #[arg(long, value_enum)]
    shape: Shape,
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
