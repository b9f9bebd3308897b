//! The engine: one OS thread that owns the backend, takes jobs first-in first-out from a bounded queue and runs
//! their sequences one at a time, streaming per-token events back through a tokio channel.
//!
//! Cancellation: before each decode step, and between the slices of a prompt's prefill where the backend can
//! split it, the engine checks the job's cancel flag (set when the client's response is dropped, i.e. it
//! disconnected), whether the event receiver is gone, and the server-wide cancel flag (set at shutdown once the
//! grace period is over). A cancelled job stops within one decode step or prefill slice; a job whose client hangs
//! up while it waits leaves the queue at once.

use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
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

/// What every sequence of a request shares. The sequences hold it behind one `Arc`, so that a request's stop
/// strings, tools and logit bias exist once however many choices it asks for.
#[derive(Debug)]
pub struct RequestSpec {
    pub kind: OutputKind,
    pub penalties: Penalties,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    /// `Some(k)`: report the chosen token's logprob and the k most likely tokens.
    pub logprobs: Option<usize>,
    /// `Some(k)`: also report each prompt token's logprob (after the first) and the k most likely tokens there.
    pub prompt_logprobs: Option<usize>,
    /// The constraint the output is held to (structured outputs, required tool calls).
    pub constraint: Option<Grammar>,
}

impl RequestSpec {
    /// Whether the engine needs the logits on the host for this request: penalties, logit bias and logprobs work
    /// on a copy of the logits. Otherwise the backend samples (on a GPU without copying the logits out, where its
    /// sampler can: see `Backend::samples_on_device`).
    pub fn needs_host_logits(&self) -> bool {
        self.penalties.is_active() || self.logprobs.is_some()
    }
}

/// One sequence to generate (a choice of the response).
#[derive(Debug, Clone)]
pub struct SequenceSpec {
    /// The choice's `index` in the response.
    pub index: usize,
    pub prompt: Arc<Vec<u32>>,
    /// The rendered prompt text (its end tells the reasoning parser where output starts).
    pub prompt_text: Arc<str>,
    /// The request's sampling parameters with this choice's seed.
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    pub request: Arc<RequestSpec>,
}

impl SequenceSpec {
    /// Tokens this sequence may occupy: its prompt plus the most it may generate.
    pub fn work(&self) -> usize {
        self.prompt.len() + self.max_tokens
    }
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
    /// The prompt's tokens with their logprobs (from the second token on), sent before the sequence's first
    /// token when the sequence asks for `prompt_logprobs`.
    PromptLogprobs {
        index: usize,
        first_token: u32,
        logprobs: Vec<TokenLogprob>,
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
    pub queue: JobQueue,
    /// Requests queued, running or still sending their response: shutdown waits for these.
    pub in_flight: AtomicUsize,
}

/// The jobs waiting for the engine, first in first out, at most `max` of them. A job whose client hangs up while
/// it waits is taken out at once ([`JobQueue::withdraw`]), so that it neither holds a place nor keeps its memory.
pub struct JobQueue {
    state: Mutex<QueueState>,
    available: Condvar,
    max: usize,
    metrics: Arc<Metrics>,
}

struct QueueState {
    jobs: VecDeque<(u64, Job)>,
    next_id: u64,
    /// No more jobs will come: the engine stops once the queue is empty.
    closed: bool,
}

pub enum SubmitError {
    QueueFull,
    EngineGone,
}

impl JobQueue {
    pub fn new(max: usize, metrics: Arc<Metrics>) -> JobQueue {
        JobQueue {
            state: Mutex::new(QueueState {
                jobs: VecDeque::new(),
                next_id: 0,
                closed: false,
            }),
            available: Condvar::new(),
            max,
            metrics,
        }
    }

    fn lock(&self) -> MutexGuard<'_, QueueState> {
        // The lock is never held across anything that can panic, but a poisoned queue is still a usable one.
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The most jobs that may wait.
    pub fn max(&self) -> usize {
        self.max
    }

    /// Jobs waiting now.
    pub fn len(&self) -> usize {
        self.lock().jobs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Queues a job without waiting: a full queue is refused at once. Returns the job's id for `withdraw`.
    pub fn submit(&self, job: Job) -> Result<u64, SubmitError> {
        let mut state = self.lock();
        if state.closed {
            return Err(SubmitError::EngineGone);
        }
        if state.jobs.len() >= self.max {
            self.metrics.rejected.increment(1);
            return Err(SubmitError::QueueFull);
        }
        let id = state.next_id;
        state.next_id += 1;
        state.jobs.push_back((id, job));
        self.metrics.queue_depth.set(state.jobs.len() as f64);
        drop(state);
        self.available.notify_one();
        Ok(id)
    }

    /// Takes the job out of the queue if it is still waiting; true when it was.
    pub fn withdraw(&self, id: u64) -> bool {
        let mut state = self.lock();
        let Some(at) = state.jobs.iter().position(|(queued, _)| *queued == id) else {
            return false;
        };
        let job = state.jobs.remove(at);
        self.metrics.queue_depth.set(state.jobs.len() as f64);
        self.metrics.cancelled.increment(1);
        drop(state);
        // The job (its prompts and its event sender) is dropped outside the lock.
        drop(job);
        true
    }

    /// Waits for the next job; `None` once the queue is closed and empty.
    fn pop(&self) -> Option<Job> {
        let mut state = self.lock();
        loop {
            if let Some((_, job)) = state.jobs.pop_front() {
                self.metrics.queue_depth.set(state.jobs.len() as f64);
                return Some(job);
            }
            if state.closed {
                return None;
            }
            state = self
                .available
                .wait(state)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
        }
    }

    fn close(&self) {
        self.lock().closed = true;
        self.available.notify_all();
    }
}

/// The HTTP side's end of the queue; dropping it closes the queue, which ends the engine's loop once the jobs
/// still waiting are served.
pub struct EngineHandle {
    pub shared: Arc<EngineShared>,
}

impl EngineHandle {
    pub fn new(shared: Arc<EngineShared>) -> EngineHandle {
        EngineHandle { shared }
    }

    pub fn submit(&self, job: Job) -> Result<u64, SubmitError> {
        self.shared.queue.submit(job)
    }
}

impl Drop for EngineHandle {
    fn drop(&mut self) {
        self.shared.queue.close();
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

/// Whether the client hung up, the job was cancelled, or the server cancels everything.
enum Outcome {
    Finished(FinalOutput),
    Cancelled,
}

/// Whether the job should stop: its client hung up (the response was dropped or the event receiver is gone), or
/// the server cancels everything.
fn is_cancelled(shared: &EngineShared, job: &Job) -> bool {
    job.cancel.load(Ordering::Relaxed) || job.events.is_closed() || shared.cancel_all.load(Ordering::Relaxed)
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

    /// Serves jobs until the queue is closed and empty.
    pub fn run(mut self) {
        while let Some(job) = self.shared.queue.pop() {
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
        is_cancelled(&self.shared, job)
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
        let forward_error = |e: lily_model::ForwardError| ApiError::internal(format!("forward pass failed: {e}"));
        let tokenizer_error = |e: lily_chat::TokenizerError| ApiError::internal(format!("detokenizing failed: {e}"));
        let constraint_error = |e: lily_structured::ConstraintError| ApiError::internal(e.to_string());
        let shared = self.shared.clone();
        match seq.request.prompt_logprobs {
            None => {
                let prefilled = self
                    .backend
                    .prefill_cancellable(&seq.prompt, &|| is_cancelled(&shared, job))
                    .map_err(forward_error)?;
                if !prefilled {
                    return Ok(Outcome::Cancelled);
                }
            }
            Some(top) => {
                let prompt = &seq.prompt;
                let mut entries = Vec::with_capacity(prompt.len().saturating_sub(1));
                let mut cancelled = false;
                self.backend
                    .prefill_each(prompt, &mut |i, logits| {
                        if let Some(&next) = prompt.get(i + 1) {
                            entries.push(logits::logprobs(logits, next, top));
                        }
                        cancelled = is_cancelled(&shared, job);
                        !cancelled
                    })
                    .map_err(forward_error)?;
                let event = Event::PromptLogprobs {
                    index: seq.index,
                    first_token: prompt[0],
                    logprobs: entries,
                };
                if cancelled || job.events.send(event).is_err() {
                    return Ok(Outcome::Cancelled);
                }
            }
        }
        self.shared.metrics.prompt_tokens.increment(seq.prompt.len() as u64);
        let request = &*seq.request;
        let options = OutputOptions {
            eos_token_ids: if request.ignore_eos {
                Vec::new()
            } else {
                self.eos.clone()
            },
            stop_strings: request.stop.clone(),
            max_tokens: Some(seq.max_tokens),
            tools: match &request.kind {
                OutputKind::Chat { tools } => tools.clone(),
                OutputKind::Text => Vec::new(),
            },
            call_ids: self.call_ids,
        };
        let mut output = match request.kind {
            OutputKind::Chat { .. } => OutputStream::new(self.tokenizer.clone(), &seq.prompt_text, options),
            OutputKind::Text => OutputStream::raw(self.tokenizer.clone(), options),
        };
        let mut sampler = Sampler::new(seq.sampling.clone());
        let mut history = History::new(&seq.prompt, &request.penalties);
        // A chat output that starts inside the prompt's think block is constrained only after `</think>`.
        let in_reasoning = match request.kind {
            OutputKind::Chat { .. } => lily_chat::ReasoningParser::for_prompt(&seq.prompt_text).in_reasoning(),
            OutputKind::Text => false,
        };
        let mut constraint = request.constraint.as_ref().map(|g| Constraint::new(g, in_reasoning));
        // Penalties and logprobs work on a copy of the logits (a constrained one masks that copy); otherwise the
        // backend samples, with the constraint's mask where there is one.
        let copy_logits = request.needs_host_logits();
        let mut last_token_at: Option<Instant> = None;
        loop {
            let (token, logprob) = if copy_logits {
                // The constraint's mask depends only on the tokens so far, so it is computed first, while a GPU
                // still runs the step queued last; reading the logits then waits for that step.
                let mask = match constraint.as_mut() {
                    Some(c) => c.mask().map_err(constraint_error)?,
                    None => None,
                };
                self.scratch.clear();
                self.scratch
                    .extend_from_slice(self.backend.logits().map_err(forward_error)?);
                logits::apply(&mut self.scratch, &request.penalties, &history);
                // Logprobs are the model's, before the mask: the masked copy is a second buffer then.
                let token = match mask {
                    Some(mask) if request.logprobs.is_some() => {
                        self.masked.clear();
                        self.masked.extend_from_slice(&self.scratch);
                        sampler.sample_masked(&mut self.masked, mask)
                    }
                    Some(mask) => sampler.sample_masked(&mut self.scratch, mask),
                    None => sampler.sample(&self.scratch),
                };
                (
                    token,
                    request.logprobs.map(|top| logits::logprobs(&self.scratch, token, top)),
                )
            } else {
                // As above, the mask is computed while a GPU still runs the step queued last.
                let mask = match constraint.as_mut() {
                    Some(c) => c.mask().map_err(constraint_error)?,
                    None => None,
                };
                let token = match mask {
                    Some(mask) => self.backend.sample_masked(&mut sampler, mask),
                    None => self.backend.sample(&mut sampler),
                };
                (token.map_err(forward_error)?, None)
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
            let is_eos = !request.ignore_eos && self.eos.contains(&token);
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
