//! `lily`: the command-line entry point.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod generate;
mod synth_cmd;

#[derive(Parser)]
#[command(name = "lily", version, about = "An inference server for Qwen3.5/3.6-35B-A3B")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a continuation of a prompt and report prefill and decode speed.
    Generate(generate::GenerateArgs),
    /// Write a synthetic checkpoint (random weights, MLX 4-bit layout) at a tiny or the full shape.
    Synth(synth_cmd::SynthArgs),
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("LILY_LOG").unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Generate(args) => generate::run(args),
        Command::Synth(args) => synth_cmd::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

