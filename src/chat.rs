//! `lily chat`: an interactive terminal chat with the model, and the one-turn generation it shares with
//! `lily generate --chat`.
//!
//! Each turn renders the whole conversation with the model directory's chat template, prefills it (the backend
//! keeps no prefix between turns yet) and streams the answer through `lily_chat::OutputStream`, which splits it
//! into reasoning and content. Ctrl-C during an answer stops it at the next decode step and returns to the prompt;
//! at the prompt, Ctrl-C twice or Ctrl-D (end of input) quits.

use std::io::{BufRead, IsTerminal, Write};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use lily_chat::{
    ChatTemplate, Delta, FinalOutput, FinishReason, OutputOptions, OutputStream, RenderRequest, Tokenizer,
};
use lily_model::sampling::Sampler;
use lily_model::Backend;
use serde_json::{json, Map, Value as Json};

use crate::generate::{load_model, model_dir, ModelArgs, SamplingArgs};

#[derive(Args)]
pub struct ChatArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Most tokens per answer (reasoning included).
    #[arg(long, default_value_t = 4096)]
    max_tokens: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Turn thinking off (the template's enable_thinking=false).
    #[arg(long, conflicts_with = "think")]
    no_think: bool,
    /// Turn thinking on (enable_thinking=true). Without --think or --no-think, the chat template's default.
    #[arg(long)]
    think: bool,
    /// Fold the model's thinking: show a one-line marker while it thinks instead of its text.
    #[arg(long)]
    hide_thinking: bool,
    /// A system prompt (change it during the chat with /system TEXT).
    #[arg(long)]
    system: Option<String>,
    /// Tokens of context (the whole conversation plus the answer) to allocate state for.
    #[arg(long, default_value_t = 8192)]
    context: usize,
    /// Where to run: CUDA where a GPU is usable (auto), or the one named.
    #[arg(long, value_enum, default_value = "auto")]
    device: crate::cuda_cmd::Device,
    #[command(flatten)]
    kernels: crate::cuda_cmd::KernelArgs,
    /// Print prompt size and speed after each answer.
    #[arg(long)]
    stats: bool,
}

/// One generated assistant turn.
pub struct Turn {
    /// The whole output, and the deltas held back until its end (not yet handed to `on_delta`).
    pub output: FinalOutput,
    /// Stopped by the caller's interrupt flag.
    pub interrupted: bool,
    pub prompt_tokens: usize,
    pub prefill_secs: f64,
    pub decode_steps: usize,
    pub decode_secs: f64,
}

impl Turn {
    /// The reasoning and the answer, trimmed. When the answer is the turn's reasoning (it ended inside the think
    /// block that the prompt opened, see `FinalOutput::content_is_reasoning`), it is not reasoning as well.
    pub fn answer(&self) -> (&str, &str) {
        let reasoning = if self.output.content_is_reasoning {
            ""
        } else {
            self.output.reasoning.trim()
        };
        (reasoning, self.output.content.trim())
    }

    pub fn stats_line(&self) -> String {
        format!(
            "prefill: {} tokens in {:.3} s ({:.1} tok/s); decode: {} tokens in {:.3} s ({:.1} tok/s)",
            self.prompt_tokens,
            self.prefill_secs,
            self.prompt_tokens as f64 / self.prefill_secs.max(1e-9),
            self.decode_steps,
            self.decode_secs,
            self.decode_steps as f64 / self.decode_secs.max(1e-9)
        )
    }
}

/// `enable_thinking` from a `--think` / `--no-think` pair: None leaves it to the template's default.
pub fn thinking_flag(think: bool, no_think: bool) -> Option<bool> {
    match (think, no_think) {
        (true, _) => Some(true),
        (_, true) => Some(false),
        _ => None,
    }
}

/// Renders a conversation for generation: `add_generation_prompt`, thinking on, off, or (None) as the template
/// decides by default.
pub fn render_prompt(template: &ChatTemplate, messages: Vec<Json>, enable_thinking: Option<bool>) -> Result<String> {
    let mut kwargs = Map::new();
    if let Some(enable_thinking) = enable_thinking {
        kwargs.insert("enable_thinking".into(), Json::Bool(enable_thinking));
    }
    let request = RenderRequest {
        messages,
        tools: None,
        add_generation_prompt: true,
        kwargs,
    };
    Ok(template.render(&request)?)
}

/// Starts a new sequence with `prompt` and returns the seconds its prefill took. A GPU backend queues the prefill
/// and returns before the device has run it, so the clock is read after waiting for the backend to finish.
pub fn timed_prefill(backend: &mut dyn Backend, prompt: &[u32]) -> Result<f64> {
    let start = Instant::now();
    backend.prefill(prompt)?;
    backend.synchronize()?;
    Ok(start.elapsed().as_secs_f64())
}

/// Generates one assistant turn for a rendered prompt: prefill, then sample and decode until an end-of-sequence
/// token, `options.max_tokens`, the end of the context or `interrupt`, handing each delta to `on_delta` as it comes.
/// The deltas held back until the end are left to the caller, in the turn's `output.deltas`.
/// (`options` without tools: a prompt offering tools needs them passed for tool calls to be parsed.)
pub fn generate_turn(
    backend: &mut dyn Backend,
    sampler: &mut Sampler,
    tokenizer: &Arc<Tokenizer>,
    prompt_text: &str,
    options: OutputOptions,
    interrupt: Option<&AtomicBool>,
    mut on_delta: impl FnMut(Delta) -> Result<()>,
) -> Result<Turn> {
    let prompt = tokenizer.encode(prompt_text, false)?;
    if prompt.is_empty() {
        bail!("the prompt is empty");
    }
    let max_context = backend.max_context();
    if prompt.len() >= max_context {
        bail!(
            "the prompt ({} tokens) fills the context ({max_context} tokens)",
            prompt.len()
        );
    }
    let room = max_context - prompt.len();
    let budget = options.max_tokens.map_or(room, |max_tokens| max_tokens.min(room));

    let prefill_secs = timed_prefill(backend, &prompt)?;

    let options = OutputOptions {
        max_tokens: Some(budget),
        ..options
    };
    let mut output = OutputStream::new(tokenizer.clone(), prompt_text, options);
    let decode_start = Instant::now();
    let mut decode_steps = 0;
    let mut interrupted = false;
    loop {
        if interrupt.is_some_and(|flag| flag.load(Ordering::SeqCst)) {
            interrupted = true;
            break;
        }
        let token = backend.sample(sampler)?;
        for delta in output.push_token(token)? {
            on_delta(delta)?;
        }
        if output.is_finished() {
            break;
        }
        backend.decode(token)?;
        decode_steps += 1;
    }
    let decode_secs = decode_start.elapsed().as_secs_f64();
    Ok(Turn {
        output: output.finish()?,
        interrupted,
        prompt_tokens: prompt.len(),
        prefill_secs,
        decode_steps,
        decode_secs,
    })
}

const DIM: &str = "\x1b[2m";
const BOLD: &str = "\x1b[1m";
const RESET: &str = "\x1b[0m";

#[derive(Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Nothing but whitespace shown yet.
    Idle,
    Thinking,
    Answering,
}

/// Writes one streamed answer to the terminal: thinking dimmed (or between `[thinking]` and `[/thinking]` lines
/// without colour) or folded to a marker, then the answer. Whitespace around each part is dropped.
struct AnswerView<W: Write> {
    out: W,
    color: bool,
    hide_thinking: bool,
    phase: Phase,
    /// Trailing whitespace not written yet: written only if more text follows in the same part.
    pending_space: String,
}

impl<W: Write> AnswerView<W> {
    fn new(out: W, color: bool, hide_thinking: bool) -> Self {
        Self {
            out,
            color,
            hide_thinking,
            phase: Phase::Idle,
            pending_space: String::new(),
        }
    }

    fn delta(&mut self, delta: Delta) -> Result<()> {
        match delta {
            Delta::Reasoning(text) => self.reasoning(&text)?,
            Delta::Content(text) => self.content(&text)?,
            // No tools are offered in a terminal chat; the parser then leaves tool-call markup as content.
            Delta::ToolCall(_) => {}
        }
        self.out.flush()?;
        Ok(())
    }

    fn reasoning(&mut self, text: &str) -> Result<()> {
        match self.phase {
            Phase::Idle => {
                if text.trim().is_empty() {
                    return Ok(());
                }
                self.phase = Phase::Thinking;
                match (self.hide_thinking, self.color) {
                    (true, true) => write!(self.out, "{DIM}thinking…{RESET}")?,
                    (true, false) => write!(self.out, "[thinking…]")?,
                    (false, true) => write!(self.out, "{DIM}")?,
                    (false, false) => writeln!(self.out, "[thinking]")?,
                }
                if !self.hide_thinking {
                    self.text(text.trim_start())?;
                }
            }
            Phase::Thinking if !self.hide_thinking => self.text(text)?,
            // Reasoning after the answer began cannot happen with this family's parser; fold it away.
            _ => {}
        }
        Ok(())
    }

    fn content(&mut self, text: &str) -> Result<()> {
        if self.phase != Phase::Answering {
            if text.trim().is_empty() {
                return Ok(());
            }
            self.end_thinking()?;
            self.phase = Phase::Answering;
            self.text(text.trim_start())
        } else {
            self.text(text)
        }
    }

    /// Writes text, keeping its trailing whitespace back until more text comes.
    fn text(&mut self, text: &str) -> Result<()> {
        let body = text.trim_end();
        if body.is_empty() {
            self.pending_space.push_str(text);
            return Ok(());
        }
        let pending = std::mem::take(&mut self.pending_space);
        write!(self.out, "{pending}{body}")?;
        self.pending_space.push_str(&text[body.len()..]);
        Ok(())
    }

    fn end_thinking(&mut self) -> Result<()> {
        self.pending_space.clear();
        if self.phase == Phase::Thinking {
            match (self.hide_thinking, self.color) {
                (true, true) => write!(self.out, "\r\x1b[2K")?,
                (true, false) => writeln!(self.out)?,
                (false, true) => write!(self.out, "{RESET}\n\n")?,
                (false, false) => write!(self.out, "\n[/thinking]\n")?,
            }
        }
        Ok(())
    }

    /// Writes the deltas held back until the end of the turn. An answer that is the turn's thinking (see
    /// `FinalOutput::content_is_reasoning`) is on the screen already, unless the thinking was folded away.
    fn final_deltas(&mut self, output: &FinalOutput) -> Result<()> {
        for delta in &output.deltas {
            let shown_as_thinking =
                output.content_is_reasoning && !self.hide_thinking && matches!(delta, Delta::Content(_));
            if !shown_as_thinking {
                self.delta(delta.clone())?;
            }
        }
        Ok(())
    }

    /// Ends the answer with a newline and a note on why it ended early, if it did.
    fn finish(&mut self, note: Option<&str>) -> Result<()> {
        self.pending_space.clear();
        match (self.phase, self.hide_thinking, self.color) {
            (Phase::Idle, _, _) => {}
            (Phase::Thinking, false, true) => writeln!(self.out, "{RESET}")?,
            (Phase::Thinking, false, false) => write!(self.out, "\n[/thinking]\n")?,
            (Phase::Thinking, true, _) | (Phase::Answering, _, _) => writeln!(self.out)?,
        }
        if let Some(note) = note {
            if self.color {
                writeln!(self.out, "{DIM}[{note}]{RESET}")?;
            } else {
                writeln!(self.out, "[{note}]")?;
            }
        }
        self.out.flush()?;
        Ok(())
    }
}

/// What the SIGINT handler sees: whether an answer is being generated, and presses at the prompt.
struct Interrupts {
    generating: AtomicBool,
    stop: AtomicBool,
    presses_at_prompt: AtomicUsize,
}

fn color_enabled() -> bool {
    std::io::stdout().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|value| value.is_empty())
}

fn print_prompt(color: bool) {
    let mut out = std::io::stdout().lock();
    let _ = if color {
        write!(out, "{BOLD}>{RESET} ")
    } else {
        write!(out, "> ")
    };
    let _ = out.flush();
}

const HELP: &str = "commands: /reset (start over), /system TEXT (set the system prompt; /system alone removes it), \
                    /exit; Ctrl-C stops an answer; Ctrl-C twice or Ctrl-D at the prompt quits";

pub fn run(args: ChatArgs) -> Result<()> {
    args.kernels.apply();
    let dir = model_dir(&args.model)?;
    let params = args.sampling.params(&dir)?;
    if args.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    let tokenizer = Arc::new(Tokenizer::from_dir(&dir)?);
    let template = ChatTemplate::from_dir(&dir)?;
    let mut backend = crate::cuda_cmd::backend(args.device, &dir, args.context, || load_model(&dir))?;
    let eos = backend.config().eos_token_ids.clone();
    let mut sampler = Sampler::new(params);
    let color = color_enabled();

    let interrupts = Arc::new(Interrupts {
        generating: AtomicBool::new(false),
        stop: AtomicBool::new(false),
        presses_at_prompt: AtomicUsize::new(0),
    });
    {
        let interrupts = interrupts.clone();
        ctrlc::set_handler(move || {
            if interrupts.generating.load(Ordering::SeqCst) {
                interrupts.stop.store(true, Ordering::SeqCst);
            } else if interrupts.presses_at_prompt.fetch_add(1, Ordering::SeqCst) >= 1 {
                println!();
                std::process::exit(0);
            } else {
                println!("\n(press Ctrl-C again or Ctrl-D to quit, or type /exit)");
                print_prompt(color);
            }
        })
        .context("installing the Ctrl-C handler")?;
    }

    let name = dir
        .file_name()
        .map_or_else(|| dir.display().to_string(), |name| name.to_string_lossy().into_owned());
    let banner = format!("lily chat: {name} on {}. {HELP}.", backend.describe());
    if color {
        println!("{DIM}{banner}{RESET}");
    } else {
        println!("{banner}");
    }

    let mut system = args.system.clone().filter(|text| !text.trim().is_empty());
    let mut history: Vec<Json> = Vec::new();
    let stdin = std::io::stdin();
    let mut line = String::new();
    loop {
        print_prompt(color);
        line.clear();
        if stdin.lock().read_line(&mut line).context("reading standard input")? == 0 {
            println!();
            return Ok(());
        }
        interrupts.presses_at_prompt.store(0, Ordering::SeqCst);
        let input = line.trim_end_matches(['\n', '\r']);
        if input.trim().is_empty() {
            continue;
        }
        if let Some(command) = input.trim().strip_prefix('/') {
            let (name, rest) = command.split_once(char::is_whitespace).unwrap_or((command, ""));
            let rest = rest.trim();
            match name {
                "exit" | "quit" => return Ok(()),
                "reset" => {
                    history.clear();
                    println!("(conversation cleared)");
                }
                "system" if rest.is_empty() => {
                    system = None;
                    println!("(system prompt removed)");
                }
                "system" => {
                    system = Some(rest.to_string());
                    println!("(system prompt set)");
                }
                "help" => println!("{HELP}"),
                _ => println!("unknown command /{name}; {HELP}"),
            }
            continue;
        }

        history.push(json!({"role": "user", "content": input}));
        let mut messages = Vec::with_capacity(history.len() + 1);
        if let Some(system) = &system {
            messages.push(json!({"role": "system", "content": system}));
        }
        messages.extend(history.iter().cloned());
        let prompt_text = match render_prompt(&template, messages, thinking_flag(args.think, args.no_think)) {
            Ok(text) => text,
            Err(error) => {
                history.pop();
                println!("error: {error:#}");
                continue;
            }
        };

        interrupts.stop.store(false, Ordering::SeqCst);
        interrupts.generating.store(true, Ordering::SeqCst);
        let mut view = AnswerView::new(std::io::stdout(), color, args.hide_thinking);
        let result = generate_turn(
            backend.as_mut(),
            &mut sampler,
            &tokenizer,
            &prompt_text,
            OutputOptions {
                eos_token_ids: eos.clone(),
                max_tokens: Some(args.max_tokens),
                ..Default::default()
            },
            Some(&interrupts.stop),
            |delta| view.delta(delta),
        );
        interrupts.generating.store(false, Ordering::SeqCst);
        let turn = match result {
            Ok(turn) => turn,
            Err(error) => {
                history.pop();
                view.finish(None)?;
                println!("error: {error:#}");
                if format!("{error:#}").contains("context") {
                    println!("(the conversation no longer fits: /reset, or start again with a larger --context)");
                }
                continue;
            }
        };
        let note = if turn.interrupted {
            Some("interrupted")
        } else if turn.output.finish_reason == FinishReason::Length {
            Some("stopped: token limit")
        } else {
            None
        };
        view.final_deltas(&turn.output)?;
        view.finish(note)?;
        let (reasoning, content) = turn.answer();
        if args.stats {
            let stats = turn.stats_line();
            if color {
                println!("{DIM}{stats}{RESET}");
            } else {
                println!("{stats}");
            }
        }
        if turn.interrupted && content.is_empty() {
            // Stopped before any answer: forget the question too, so the next turn starts from a clean exchange.
            history.pop();
            continue;
        }
        let mut message = json!({"role": "assistant", "content": content});
        if !reasoning.is_empty() {
            message["reasoning_content"] = Json::String(reasoning.to_string());
        }
        history.push(message);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use lily_model::sampling::SamplingParams;
    use lily_model::{Config, ForwardError};

    use super::*;

    /// Runs like a GPU: `prefill` only queues `PREFILL_WORK` of device time and returns; `synchronize` and reading
    /// the logits wait for the queued work to finish. Its logits always pick `<|im_end|>`.
    struct QueuedBackend {
        config: Config,
        logits: Vec<f32>,
        busy_until: Option<Instant>,
    }

    const PREFILL_WORK: Duration = Duration::from_millis(300);

    impl QueuedBackend {
        fn wait(&mut self) {
            if let Some(until) = self.busy_until.take() {
                std::thread::sleep(until.saturating_duration_since(Instant::now()));
            }
        }
    }

    impl Backend for QueuedBackend {
        fn config(&self) -> &Config {
            &self.config
        }
        fn max_context(&self) -> usize {
            4096
        }
        fn prefill(&mut self, _prompt: &[u32]) -> Result<(), ForwardError> {
            self.busy_until = Some(Instant::now() + PREFILL_WORK);
            Ok(())
        }
        fn decode(&mut self, _token: u32) -> Result<(), ForwardError> {
            Ok(())
        }
        fn logits(&mut self) -> Result<&[f32], ForwardError> {
            self.wait();
            Ok(&self.logits)
        }
        fn synchronize(&mut self) -> Result<(), ForwardError> {
            self.wait();
            Ok(())
        }
        fn describe(&self) -> String {
            "queued".into()
        }
    }

    #[test]
    fn the_prefill_is_timed_once_the_device_has_run_it() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models/lily-tiny-shakespeare");
        let tokenizer = Arc::new(Tokenizer::from_dir(&dir).unwrap());
        let im_end = tokenizer.special().im_end;
        let config = Config::tiny_shape();
        let mut logits = vec![0.0; config.vocab_size];
        logits[im_end as usize] = 10.0;
        let mut backend = QueuedBackend {
            config,
            logits,
            busy_until: None,
        };
        let mut sampler = Sampler::new(SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        });
        let options = OutputOptions {
            eos_token_ids: vec![im_end],
            max_tokens: Some(4),
            ..Default::default()
        };
        let turn = generate_turn(
            &mut backend,
            &mut sampler,
            &tokenizer,
            "ROMEO.\n",
            options,
            None,
            |_| Ok(()),
        )
        .unwrap();
        assert_eq!(turn.output.completion_tokens, 1);
        // The device's prefill time is the prefill's, not the first decode step's.
        assert!(
            turn.prefill_secs >= PREFILL_WORK.as_secs_f64(),
            "prefill timed at {:.3} s, before the device finished it",
            turn.prefill_secs
        );
        assert!(
            turn.decode_secs < PREFILL_WORK.as_secs_f64(),
            "the decode time ({:.3} s) holds the prefill's",
            turn.decode_secs
        );
    }
}
