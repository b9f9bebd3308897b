//! `lily`: the command-line entry point.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod chat;
mod cpu_bench;
mod cuda_cmd;
mod generate;
mod inspect;
mod serve;
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
    /// Chat with the model in the terminal: multi-turn, streaming, thinking shown apart from the answer.
    Chat(chat::ChatArgs),
    /// Print the token ids of a text as a JSON list (--decode: the text of token ids).
    Tokenize(inspect::TokenizeArgs),
    /// Print the exact prompt the chat template makes of an OpenAI-style {"messages", "tools"} request body.
    Render(inspect::RenderArgs),
    /// Check every CUDA kernel and the whole GPU model against the CPU backend (needs a GPU, except
    /// --compile-only).
    Selftest(cuda_cmd::SelftestArgs),
    /// Measure decode and prompt speed on the GPU or the CPU, llama-bench style.
    Bench(cuda_cmd::BenchArgs),
    /// Serve the OpenAI-compatible HTTP API (chat, completions, models, tokenize, metrics).
    Serve(serve::ServeCmd),
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
        Command::Chat(args) => chat::run(args),
        Command::Tokenize(args) => inspect::run_tokenize(args),
        Command::Render(args) => inspect::run_render(args),
        Command::Selftest(args) => cuda_cmd::selftest(args),
        Command::Bench(args) => cuda_cmd::bench(args),
        Command::Serve(args) => serve::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
