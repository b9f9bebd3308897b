//! The engine: one OS thread that owns the backend, takes jobs first-in first-out from a bounded queue and runs
//! their sequences one at a time, streaming per-token events back through a tokio channel.
//!
//! Cancellation: before each decode step the engine checks the job's cancel flag (set when the client's response
//! is dropped, i.e. it disconnected), whether the event receiver is gone, and the server-wide cancel flag (set at
//! shutdown once the grace period is over). A cancelled job stops within one decode step.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::Instant;

use lily_chat::{Delta, FinalOutput, OutputOptions, OutputStream, Tokenizer, ToolCallIds};
use lily_model::sampling::{Sampler, SamplingParams};
use lily_model::Backend;
use lily_structured::{Constraint, Grammar};
use serde_json::Value as Json;
use tokio::sync::mpsc::UnboundedSender;

use crate::error::ApiError;
use crate::logits::{self, History, Penalties, TokenLogprob};
use crate::metrics::Metrics;

/// How generated tokens become text.
#[derive(Debug, Clone)]
pub enum OutputKind {
    /// Chat: reasoning split and, when `tools` is non-empty, tool-call parsing.
    Chat { tools: Vec<Json> },
    /// Completions: raw text, special tokens skipped.
    Text,
}

/// One sequence to generate (a choice of the response).
#[derive(Debug, Clone)]
pub struct SequenceSpec {
    /// The choice's `index` in the response.
    pub index: usize,
    pub prompt: Arc<Vec<u32>>,
    /// The rendered prompt text (its end tells the reasoning parser where output starts).
    pub prompt_text: Arc<str>,
    pub kind: OutputKind,
    pub sampling: SamplingParams,
    pub penalties: Penalties,
    pub max_tokens: usize,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    /// `Some(k)`: report the chosen token's logprob and the k most likely tokens.
    pub logprobs: Option<usize>,
    /// The constraint the output is held to (structured outputs, required tool calls).
    pub constraint: Option<Grammar>,
}

pub struct Job {
    pub sequences: Vec<SequenceSpec>,
    pub events: UnboundedSender<Event>,
    pub cancel: Arc<AtomicBool>,
    pub arrived: Instant,
}

#[derive(Debug)]
pub enum Event {
    /// One generated token: the deltas it released (maybe none) and, when asked, its logprob (none for an
    /// end-of-sequence token).
    Token {
        index: usize,
        deltas: Vec<Delta>,
        logprob: Option<TokenLogprob>,
    },
    /// A sequence ended; `output.deltas` is text held back until the end.
    Finished { index: usize, output: FinalOutput },
    /// The job failed or was cancelled by the server; no more events follow.
    Error(ApiError),
    /// All sequences finished.
    Done,
}

/// State shared by the engine thread and the HTTP side.
pub struct EngineShared {
    pub metrics: Arc<Metrics>,
    /// Set at shutdown once the grace period is over: running and queued jobs are cancelled.
    pub cancel_all: AtomicBool,
    pub queue_depth: AtomicUsize,
    pub max_queue: usize,
}

/// The HTTP side's end of the queue.
pub struct EngineHandle {
    sender: SyncSender<Job>,
    pub shared: Arc<EngineShared>,
}

pub enum SubmitError {
    QueueFull,
    EngineGone,
}

impl EngineHandle {
    pub fn new(sender: SyncSender<Job>, shared: Arc<EngineShared>) -> EngineHandle {
        EngineHandle { sender, shared }
    }

    /// Queues a job without waiting: a full queue is refused at once.
    pub fn submit(&self, job: Job) -> Result<(), SubmitError> {
        // Counted before sending, so that the engine's decrement never comes first.
        self.shared.queue_depth.fetch_add(1, Ordering::SeqCst);
        self.shared.metrics.queue_depth.increment(1.0);
        match self.sender.try_send(job) {
            Ok(()) => Ok(()),
            Err(e) => {
                self.shared.queue_depth.fetch_sub(1, Ordering::SeqCst);
                self.shared.metrics.queue_depth.decrement(1.0);
                match e {
                    TrySendError::Full(_) => {
                        self.shared.metrics.rejected.increment(1);
                        Err(SubmitError::QueueFull)
                    }
                    TrySendError::Disconnected(_) => Err(SubmitError::EngineGone),
                }
            }
        }
    }
}

pub struct Engine {
    backend: Box<dyn Backend>,
    tokenizer: Arc<Tokenizer>,
    eos: Vec<u32>,
    call_ids: ToolCallIds,
    shared: Arc<EngineShared>,
    /// A copy of the logits for penalties, logprobs and constrained decoding.
    scratch: Vec<f32>,
    /// The copy that a constrained step masks, when `scratch` must stay whole for logprobs.
    masked: Vec<f32>,
}

enum Outcome {
    Finished(FinalOutput),
    Cancelled,
}

impl Engine {
    pub fn new(
        backend: Box<dyn Backend>,
        tokenizer: Arc<Tokenizer>,
        call_ids: ToolCallIds,
        shared: Arc<EngineShared>,
    ) -> Engine {
        let eos = backend.config().eos_token_ids.clone();
        Engine {
            backend,
            tokenizer,
            eos,
            call_ids,
            shared,
            scratch: Vec::new(),
            masked: Vec::new(),
        }
    }

    /// Serves jobs until every sender is gone.
    pub fn run(mut self, jobs: Receiver<Job>) {
        while let Ok(job) = jobs.recv() {
            self.shared.queue_depth.fetch_sub(1, Ordering::SeqCst);
            self.shared.metrics.queue_depth.decrement(1.0);
            let events = job.events.clone();
            self.shared.metrics.running.set(1.0);
            let last = std::panic::catch_unwind(AssertUnwindSafe(|| self.process(job))).unwrap_or_else(|_| {
                tracing::error!("the engine panicked while serving a request; it goes on with the next one");
                Event::Error(ApiError::internal("the engine failed while generating"))
            });
            // The gauge drops before the client hears the end, so that what it reads next is up to date.
            self.shared.metrics.running.set(0.0);
            let _ = events.send(last);
        }
        tracing::debug!("engine: queue closed, exiting");
    }

    fn cancelled(&self, job: &Job) -> bool {
        job.cancel.load(Ordering::Relaxed) || job.events.is_closed() || self.shared.cancel_all.load(Ordering::Relaxed)
    }

    /// Runs a job's sequences; returns its last event (`Done`, or an `Error`).
    fn process(&mut self, job: Job) -> Event {
        if self.cancelled(&job) {
            return self.cancel_event();
        }
        let mut first_token = true;
        for seq in &job.sequences {
            match self.generate(&job, seq, &mut first_token) {
                Ok(Outcome::Finished(output)) => {
                    let _ = job.events.send(Event::Finished {
                        index: seq.index,
                        output,
                    });
                }
                Ok(Outcome::Cancelled) => return self.cancel_event(),
                Err(error) => {
                    tracing::error!("generation failed: {error}");
                    return Event::Error(error);
                }
            }
        }
        self.shared.metrics.e2e.record(job.arrived.elapsed().as_secs_f64());
        Event::Done
    }

    fn cancel_event(&self) -> Event {
        self.shared.metrics.cancelled.increment(1);
        let error = if self.shared.cancel_all.load(Ordering::Relaxed) {
            ApiError::shutting_down().with_code("cancelled")
        } else {
            ApiError::bad_request("the request was cancelled").with_code("cancelled")
        };
        Event::Error(error)
    }

    fn generate(&mut self, job: &Job, seq: &SequenceSpec, first_token: &mut bool) -> Result<Outcome, ApiError> {
        let forward_error =
            |e: lily_model::cpu::model::ForwardError| ApiError::internal(format!("forward pass failed: {e}"));
        let tokenizer_error = |e: lily_chat::TokenizerError| ApiError::internal(format!("detokenizing failed: {e}"));
        let constraint_error = |e: lily_structured::ConstraintError| ApiError::internal(e.to_string());
        self.backend.prefill(&seq.prompt).map_err(forward_error)?;
        self.shared.metrics.prompt_tokens.increment(seq.prompt.len() as u64);
        let options = OutputOptions {
            eos_token_ids: if seq.ignore_eos { Vec::new() } else { self.eos.clone() },
            stop_strings: seq.stop.clone(),
            max_tokens: Some(seq.max_tokens),
            tools: match &seq.kind {
                OutputKind::Chat { tools } => tools.clone(),
                OutputKind::Text => Vec::new(),
            },
            call_ids: self.call_ids,
        };
        let mut output = match seq.kind {
            OutputKind::Chat { .. } => OutputStream::new(self.tokenizer.clone(), &seq.prompt_text, options),
            OutputKind::Text => OutputStream::raw(self.tokenizer.clone(), options),
        };
        let mut sampler = Sampler::new(seq.sampling.clone());
        let mut history = History::new(&seq.prompt, &seq.penalties);
        // A chat output that starts inside the prompt's think block is constrained only after `</think>`.
        let in_reasoning = match seq.kind {
            OutputKind::Chat { .. } => lily_chat::ReasoningParser::for_prompt(&seq.prompt_text).in_reasoning(),
            OutputKind::Text => false,
        };
        let mut constraint = seq.constraint.as_ref().map(|g| Constraint::new(g, in_reasoning));
        // A constrained sequence copies its logits out and masks them on the CPU, on every backend.
        let copy_logits = seq.penalties.is_active() || seq.logprobs.is_some() || constraint.is_some();
        let mut last_token_at: Option<Instant> = None;
        loop {
            let (token, logprob) = if copy_logits {
                self.scratch.clear();
                self.scratch.extend_from_slice(self.backend.logits());
                logits::apply(&mut self.scratch, &seq.penalties, &history);
                let mask = match constraint.as_mut() {
                    Some(c) => c.mask().map_err(constraint_error)?,
                    None => None,
                };
                // Logprobs are the model's, before the mask: the masked copy is a second buffer then.
                let token = match mask {
                    Some(mask) if seq.logprobs.is_some() => {
                        self.masked.clear();
                        self.masked.extend_from_slice(&self.scratch);
                        sampler.sample_masked(&mut self.masked, mask)
                    }
                    Some(mask) => sampler.sample_masked(&mut self.scratch, mask),
                    None => sampler.sample(&self.scratch),
                };
                (
                    token,
                    seq.logprobs.map(|top| logits::logprobs(&self.scratch, token, top)),
                )
            } else {
                (self.backend.sample(&mut sampler), None)
            };
            let now = Instant::now();
            match last_token_at {
                None if *first_token => {
                    self.shared.metrics.ttft.record((now - job.arrived).as_secs_f64());
                    *first_token = false;
                }
                None => {}
                Some(last) => self.shared.metrics.tpot.record((now - last).as_secs_f64()),
            }
            last_token_at = Some(now);
            self.shared.metrics.generation_tokens.increment(1);
            if let Some(c) = constraint.as_mut() {
                c.consume(token).map_err(constraint_error)?;
            }
            history.push(token);
            let deltas = output.push_token(token).map_err(tokenizer_error)?;
            let is_eos = !seq.ignore_eos && self.eos.contains(&token);
            let logprob = if is_eos { None } else { logprob };
            if job
                .events
                .send(Event::Token {
                    index: seq.index,
                    deltas,
                    logprob,
                })
                .is_err()
            {
                return Ok(Outcome::Cancelled);
            }
            if output.is_finished() {
                break;
            }
            if self.cancelled(job) {
                return Ok(Outcome::Cancelled);
            }
            self.backend.decode(token).map_err(forward_error)?;
        }
        Ok(Outcome::Finished(output.finish().map_err(tokenizer_error)?))
    }
}
