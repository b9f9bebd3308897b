//! The engine: one OS thread that owns the batch backend and runs many sequences at once (continuous batching).
//! Jobs come first-in first-out from a bounded queue; each iteration admits sequences into free slots, prefills
//! chunks of the waiting prompts, advances every running sequence by one token in one batched step, and streams
//! per-token events back through a tokio channel. See [`Engine`] for the order of an iteration.
//!
//! Cancellation: every iteration checks each job's cancel flag (set when the client's response is dropped, i.e.
//! it disconnected), whether its event receiver is gone, and the server-wide cancel flag (set at shutdown once
//! the grace period is over). A cancelled job's slots are freed within one iteration, which is the prefill budget's
//! calls and one step; a job whose client hangs up while it waits leaves the queue at once.
//!
//! A sequence's tokens do not depend on the batch around it: its sampler (and the seeded counter in it) is its
//! own, and each row of a step is computed from its own slot's state.

use std::collections::{HashMap, VecDeque};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use lily_chat::{Delta, FinalOutput, OutputOptions, OutputStream, Tokenizer, ToolCallIds};
use lily_model::sampling::{Sampler, SamplingParams};
use lily_model::{BatchBackend, ForwardError, Pick, PrefillPart, Slot, SnapshotId, StepRow};
use lily_structured::{Constraint, Grammar};
use serde_json::Value as Json;
use tokio::sync::mpsc::UnboundedSender;

use crate::error::ApiError;
use crate::logits::{self, History, Penalties, TokenLogprob};
use crate::metrics::Metrics;
use crate::prefix_cache::{PrefixCache, PrefixHashes};

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
    /// on a copy of the logits. Otherwise the backend samples (`BatchBackend::sample`, on a GPU without copying
    /// the logits out where its sampler can), a constraint's mask going with the pick.
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
    /// The rendered prompt text (its end tells the reasoning parser where output starts); empty for a completion
    /// prompt given as token ids without `echo`, which has no use for it.
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
    /// A sequence ended; `output.deltas` is text held back until the end. `cached_tokens`: the prompt tokens it
    /// took from the prefix cache instead of prefilling them (0 for a choice forked from another's prompt).
    Finished {
        index: usize,
        output: FinalOutput,
        cached_tokens: usize,
    },
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

/// The jobs waiting for the engine, first in first out: at most `max` beyond those the engine has free slots for
/// (`room`, which the engine sets each iteration and each job it takes lowers at once), since those only wait for
/// the engine's next iteration to start them. A job whose client hangs up while it waits is taken out at once ([`JobQueue::withdraw`]), so that it
/// neither holds a place nor keeps its memory.
pub struct JobQueue {
    state: Mutex<QueueState>,
    available: Condvar,
    max: usize,
    room: AtomicUsize,
    metrics: Arc<Metrics>,
}

struct QueueState {
    jobs: VecDeque<(u64, Job)>,
    next_id: u64,
    /// No more jobs will come: the engine stops once the queue is empty.
    closed: bool,
    /// The engine stopped after an error it could not recover from (the queue is closed too).
    failed: bool,
}

enum Popped {
    Job(Box<Job>),
    Empty,
    Closed,
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
                failed: false,
            }),
            available: Condvar::new(),
            max,
            room: AtomicUsize::new(0),
            metrics,
        }
    }

    /// Sets how many more jobs than `max` may wait: the engine's free slots.
    fn set_room(&self, free_slots: usize) {
        self.room.store(free_slots, Ordering::Relaxed);
    }

    /// Whether a job submitted now would be refused.
    pub fn is_full(&self) -> bool {
        self.len() >= self.max + self.room.load(Ordering::Relaxed)
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
        if state.jobs.len() >= self.max + self.room.load(Ordering::Relaxed) {
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

    /// The next job: waits for one when `wait` is set, else answers `Empty` at once when none waits; `Closed`
    /// once the queue is closed and empty.
    fn pop(&self, wait: bool) -> Popped {
        let mut state = self.lock();
        loop {
            if let Some((_, job)) = state.jobs.pop_front() {
                // The engine takes this job into free slots now, and sets the room again only at the end of its
                // iteration: until then the slots it takes must not let more jobs in.
                let taken = job.sequences.len().max(1);
                let room = self.room.load(Ordering::Relaxed);
                self.room.store(room.saturating_sub(taken), Ordering::Relaxed);
                self.metrics.queue_depth.set(state.jobs.len() as f64);
                return Popped::Job(Box::new(job));
            }
            if state.closed {
                return Popped::Closed;
            }
            if !wait {
                return Popped::Empty;
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

    /// Closes the queue for good after the engine failed: every waiting job is answered `engine_failed` at once,
    /// and later jobs are refused.
    fn fail(&self) {
        let mut state = self.lock();
        state.closed = true;
        state.failed = true;
        let jobs = std::mem::take(&mut state.jobs);
        self.metrics.queue_depth.set(0.0);
        drop(state);
        self.available.notify_all();
        for (_, job) in jobs {
            let _ = job.events.send(Event::Error(ApiError::engine_failed()));
        }
    }

    /// Whether the engine stopped after an error it could not recover from.
    pub fn has_failed(&self) -> bool {
        self.lock().failed
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

/// How the engine schedules work on its backend.
#[derive(Debug, Clone, Copy)]
pub struct EngineOptions {
    /// Prompt tokens one iteration may prefill (chunks of the earliest admitted prompts), so that a long prompt
    /// arriving delays the running sequences' next tokens by one chunk's time at most. `None`: the backend's
    /// [`BatchBackend::prefill_budget`].
    pub max_prefill_tokens: Option<usize>,
    /// Reuse the state of prompts seen before (the prefix cache): snapshots of sequences are kept in the backend
    /// and a new prompt starts from the longest one that begins it.
    pub prefix_cache: bool,
    /// A prompt is snapshotted every this many tokens (0: only where messages end and at the prompt's end).
    pub snapshot_interval: usize,
    /// Context, in tokens, that a sequence is granted past what it needs (at least 1): at admission past its
    /// prompt, and again each time a step would go past its grant. Granting context as it is used lets the pool
    /// hold what sequences have rather than the most each may reach (a request without `max_tokens` may reach the
    /// whole context); a larger grant means fewer calls to the backend, a smaller one less context held unused.
    pub grant_ahead: usize,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            max_prefill_tokens: None,
            prefix_cache: true,
            snapshot_interval: DEFAULT_SNAPSHOT_INTERVAL,
            grant_ahead: DEFAULT_GRANT_AHEAD,
        }
    }
}

/// The default of `--prefix-cache-interval`: the CPU's default prefill budget, so that these snapshots cost no
/// extra prefill call there (a GPU takes them inside its prefill passes).
pub const DEFAULT_SNAPSHOT_INTERVAL: usize = 2048;

/// Snapshots one prompt's prefill stops for at most (a snapshot of the full model's recurrent state is ~35 MB on the GPU).
const MAX_SNAPSHOTS_PER_PROMPT: usize = 12;

/// The default of [`EngineOptions::grant_ahead`]: four of the GPU's KV pages.
pub const DEFAULT_GRANT_AHEAD: usize = 256;

/// Prefill calls one iteration makes at most (a call of a few tokens costs a good part of a long one's time): a
/// prompt that stops early to snapshot goes on in the same iteration, and several short prompts enter together.
const PREFILL_CALLS_PER_ITERATION: usize = 4;

/// The continuous-batching scheduler: it owns the backend and its slots, and loops over iterations, each of which
///
/// 1. drops cancelled jobs (freeing their slots),
/// 2. admits sequences first come first served, the preempted ones (below) before any new one: the head job's
///    next sequence enters when a slot is free and the backend grants it context for its prompt and
///    `grant_ahead` tokens more (at most its prompt plus `max_tokens`); sequences of one job that share a prompt
///    enter together, the first prefills it and the others are forked from it,
/// 3. prefills chunks of the earliest admitted prompts, `max_prefill_tokens` in all and in at most
///    `PREFILL_CALLS_PER_ITERATION` calls; where the backend takes several sequences a call, the chunks of the
///    prompts after the earliest one join its call,
/// 4. runs one `step` over every sequence that has a token to append, granting `grant_ahead` more tokens of
///    context to each that has used up its grant; where the pool lacks them, the prefix cache's snapshots are
///    dropped first, and then the sequences admitted last are preempted: each gives its context back and waits,
///    ahead of new requests, to be prefilled again from its prompt and the tokens it generated (from the prefix
///    cache's longest snapshot of them), and then goes on where it stopped (vLLM's preemption by recomputation;
///    a sequence still prefilling its prompt can give way too, and starts it again),
/// 5. samples each sequence whose next-token logits are ready and sends its events.
///
/// The prefix cache: a sequence starts from the backend's snapshot of the longest prefix of its prompt that the
/// cache holds (looked up at admission and again before each chunk, since a sequence admitted earlier may have
/// cached a shared prefix meanwhile), and prefills only the rest. Its prefill stops to snapshot where the first
/// and the last message of a rendered chat begin (before `<|im_start|>`) and every `snapshot_interval` tokens,
/// and snapshots its prompt's end; a finished sequence is snapshotted as it ends (prompt and reply, for an agent's
/// next turn that extends it). A lookup leaves at least the prompt's last token to prefill, for its logits. When
/// the backend lacks memory for a sequence or a snapshot, the least recently used snapshots are dropped; a running
/// sequence never depends on one (the backend shares or copies what it restored).
pub struct Engine {
    backend: Box<dyn BatchBackend>,
    tokenizer: Arc<Tokenizer>,
    eos: Vec<u32>,
    call_ids: ToolCallIds,
    shared: Arc<EngineShared>,
    options: EngineOptions,
    /// Context a single sequence may need at most: the backend's context, and what the pool holds when empty.
    fits: usize,
    /// The jobs with sequences admitted or waiting to be, by id.
    jobs: HashMap<u64, Active>,
    next_job: u64,
    /// The job at the head of the line, whose sequences are being admitted.
    admitting: Option<u64>,
    /// The sequence in each slot.
    slots: Vec<Option<Seq>>,
    /// Admission order of sequences (the earliest admitted prompt is prefilled first).
    next_order: u64,
    /// Where the next step's rows start when more sequences are ready than a step takes.
    step_start: usize,
    /// A copy of the logits for penalties and logprobs.
    scratch: Vec<f32>,
    /// The copy that a constrained sequence masks, when `scratch` must stay whole for logprobs.
    masked: Vec<f32>,
    /// The snapshots the backend holds for reuse (none when the prefix cache is off).
    cache: PrefixCache,
    /// `<|im_start|>`, which begins every message of a rendered chat.
    message_start: Option<u32>,
    /// When the last decode step's tokens had all been handled (for the step's trace event).
    last_step_done: Option<Instant>,
    /// The step queued ahead, before the tokens of the one before it were handled (see [`Engine::step_ahead`]).
    ahead: Option<QueuedStep>,
    /// Sequences that gave their slot and context back for older ones to grow ([`Engine::preempt`]), waiting to
    /// be admitted again before any new sequence.
    preempted: Vec<Seq>,
}

/// A step queued on the backend whose tokens have not been taken yet.
struct QueuedStep {
    /// Each row's slot and the admission order of the sequence it held when the step was queued: a sequence that
    /// finished meanwhile has left its slot, and its row is passed over.
    rows: Vec<(Slot, u64)>,
    /// When queuing it began and ended.
    started: Instant,
    launched: Instant,
}

/// One sequence's part of a prefill call: prompt tokens `done .. end` of the sequence in `slot`, snapshotted inside
/// the pass after `cuts` of them (each relative to `done`); `echo` when its prompt's logprobs are asked for.
struct Chunk {
    slot: Slot,
    job: u64,
    done: usize,
    end: usize,
    cuts: Vec<usize>,
    echo: Option<usize>,
}

/// What a chunk's results released: sequences to sample (slot, output row) and prompts now in, to snapshot.
#[derive(Default)]
struct ChunkDone {
    ready: Vec<(Slot, usize)>,
    prompts: Vec<(Slot, u64, usize)>,
}

/// A job the engine works on.
struct Active {
    job: Job,
    /// Its sequences not admitted yet, in order.
    waiting: VecDeque<SequenceSpec>,
    /// Its sequences not finished yet (waiting ones included).
    unfinished: usize,
    /// No token of the job has been sent yet (for the time-to-first-token metric).
    first_token: bool,
}

/// Where a sequence stands.
enum Phase {
    /// Its prompt's first `done` tokens are in the slot.
    Prefill { done: usize },
    /// Its prompt goes through steps one token at a time, for the prompt's logprobs: `next` is the index of the
    /// prompt token the next step appends; `entries` the logprobs of the prompt's tokens 1..=next so far.
    Echo { next: usize, entries: Vec<TokenLogprob> },
    /// It shares the prompt of the sequence in slot `leader`, and is forked from it once that prompt is in.
    Follow { leader: Slot },
    /// Its next token is chosen in this iteration.
    Ready,
    /// `token` was chosen and goes into the next step.
    Decode { token: u32 },
}

struct Seq {
    job: u64,
    spec: SequenceSpec,
    order: u64,
    phase: Phase,
    /// Prompt tokens restored from the prefix cache (at its first admission: what `usage` reports).
    cached: usize,
    /// Tokens of context the backend granted its slot (the backend may round it up): a step past it needs more.
    granted: usize,
    /// It was preempted: its `spec.prompt` is now its prompt and the tokens it had generated then (its
    /// `spec.max_tokens` less those), prefilled again without counting as a prompt, echoing logprobs or taking a
    /// new `cached` count.
    resumed: bool,
    /// Prompt lengths, ascending, at which the prefill stops to snapshot the sequence for the prefix cache.
    snapshot_at: Vec<usize>,
    /// The prefix cache's hashes of its prompt's prefixes, for a sequence that uses the cache (one that prefills its
    /// prompt itself, with the cache on): such a sequence looks its prompt up, is snapshotted at `snapshot_at`, at
    /// its prompt's end and when it finishes.
    prompt_hashes: Option<PrefixHashes>,
    /// The tokens it generated (since it was last preempted: those before are in `spec.prompt`); the last one is
    /// not in the slot yet.
    generated: Vec<u32>,
    output: OutputStream,
    sampler: Sampler,
    history: History,
    constraint: Option<Constraint>,
    last_token_at: Option<Instant>,
}

/// Whether the job should stop: its client hung up (the response was dropped or the event receiver is gone), or
/// the server cancels everything.
fn is_cancelled(shared: &EngineShared, job: &Job) -> bool {
    job.cancel.load(Ordering::Relaxed) || job.events.is_closed() || shared.cancel_all.load(Ordering::Relaxed)
}

fn forward_error(e: lily_model::ForwardError) -> ApiError {
    ApiError::internal(format!("forward pass failed: {e}"))
}

/// The context a sequence is granted when it enters a slot: its prompt and `ahead` tokens more, at most its prompt
/// plus `max_tokens`.
fn first_grant(spec: &SequenceSpec, ahead: usize) -> usize {
    spec.work().min(spec.prompt.len() + ahead)
}

impl Engine {
    pub fn new(
        backend: Box<dyn BatchBackend>,
        tokenizer: Arc<Tokenizer>,
        call_ids: ToolCallIds,
        shared: Arc<EngineShared>,
        options: EngineOptions,
    ) -> Engine {
        let eos = backend.config().eos_token_ids.clone();
        let message_start = tokenizer.token_to_id("<|im_start|>");
        // Built with every slot empty, so the pool's free tokens are all it holds.
        let fits = backend.max_context().min(backend.free_tokens());
        let budget = options
            .max_prefill_tokens
            .unwrap_or_else(|| backend.prefill_budget())
            .max(1);
        let slots = (0..backend.max_seqs()).map(|_| None).collect();
        shared.queue.set_room(backend.max_seqs());
        Engine {
            backend,
            tokenizer,
            eos,
            call_ids,
            shared,
            options: EngineOptions {
                max_prefill_tokens: Some(budget),
                grant_ahead: options.grant_ahead.max(1),
                ..options
            },
            fits,
            jobs: HashMap::new(),
            next_job: 0,
            admitting: None,
            slots,
            next_order: 0,
            step_start: 0,
            scratch: Vec::new(),
            masked: Vec::new(),
            cache: PrefixCache::new(),
            message_start,
            last_step_done: None,
            ahead: None,
            preempted: Vec::new(),
        }
    }

    /// Serves jobs until the queue is closed and every job is done.
    pub fn run(mut self) {
        loop {
            match std::panic::catch_unwind(AssertUnwindSafe(|| self.iteration())) {
                Ok(true) => {}
                Ok(false) => break,
                Err(_) => {
                    tracing::error!("the engine panicked while serving requests; it fails them and goes on");
                    let error = ApiError::internal("the engine failed while generating");
                    if std::panic::catch_unwind(AssertUnwindSafe(|| self.fail_all(error))).is_err() {
                        // Even failing the jobs failed: the backend's state cannot be trusted any more. The
                        // engine stops. Its queue answers every waiting job and refuses later ones, and the jobs it
                        // still holds are answered here, without the backend, so that no client waits on an
                        // engine that is gone.
                        tracing::error!("the engine could not recover from the panic and stops serving");
                        self.shared.queue.fail();
                        for (_, active) in self.jobs.drain() {
                            let _ = active.job.events.send(Event::Error(ApiError::engine_failed()));
                        }
                        return;
                    }
                }
            }
        }
        tracing::debug!("engine: queue closed, exiting");
    }

    /// One iteration; false once the queue is closed and no job is left.
    fn iteration(&mut self) -> bool {
        if let Some(queued) = self.ahead.take() {
            self.finish_queued(queued);
            self.set_running();
            return true;
        }
        self.drop_cancelled();
        if !self.admit() {
            return false;
        }
        let prefilled = self.prefill_chunks();
        let stepped = self.decode_step();
        self.set_running();
        if !prefilled && !stepped && self.admitting.is_none() && !self.jobs.is_empty() {
            // Every admitted sequence has work each iteration, so this cannot happen; should it, failing the jobs
            // beats spinning on them forever.
            tracing::error!("engine: jobs left that no iteration advances");
            self.fail_all(ApiError::internal("the engine could not schedule the request"));
        }
        true
    }

    fn set_running(&self) {
        let running = self.slots.iter().filter(|s| s.is_some()).count();
        self.shared.metrics.running.set(running as f64);
        // The preempted sequences take the first slots that free up.
        let free = self.slots.len() - running;
        self.shared.queue.set_room(free.saturating_sub(self.preempted.len()));
    }

    fn free_slot(&self) -> Option<Slot> {
        self.slots.iter().position(|s| s.is_none())
    }

    /// Admits sequences first come first served while slots and context last, the preempted ones first. False
    /// once the queue is closed and no job is left.
    fn admit(&mut self) -> bool {
        if !self.resume_preempted() {
            return true;
        }
        loop {
            let id = match self.admitting {
                Some(id) => id,
                None => {
                    if self.free_slot().is_none() {
                        return true;
                    }
                    let idle = self.jobs.is_empty();
                    let job = match self.shared.queue.pop(idle) {
                        Popped::Job(job) => *job,
                        Popped::Empty => return true,
                        Popped::Closed => return !idle,
                    };
                    if is_cancelled(&self.shared, &job) {
                        let _ = job.events.send(self.cancel_event());
                        continue;
                    }
                    if let Some(error) = self.never_fits(&job) {
                        let _ = job.events.send(Event::Error(error));
                        continue;
                    }
                    let id = self.next_job;
                    self.next_job += 1;
                    let active = Active {
                        waiting: job.sequences.iter().cloned().collect(),
                        unfinished: job.sequences.len(),
                        first_token: true,
                        job,
                    };
                    self.jobs.insert(id, active);
                    self.admitting = Some(id);
                    id
                }
            };
            if !self.admit_from(id) {
                return true;
            }
            if self.admitting == Some(id) {
                self.admitting = None;
            }
            self.finish_job_if_done(id);
        }
    }

    /// The refusal of a job one of whose sequences could never be admitted, however long it waited.
    fn never_fits(&self, job: &Job) -> Option<ApiError> {
        let seq = job.sequences.iter().find(|s| s.work() > self.fits)?;
        Some(
            ApiError::invalid(
                "max_tokens",
                format!(
                    "The request needs {} tokens of context for one sequence (prompt plus `max_tokens`), but this \
                     server holds at most {} tokens for a sequence; lower `max_tokens` or shorten the prompt.",
                    seq.work(),
                    self.fits
                ),
            )
            .with_code("context_length_exceeded"),
        )
    }

    /// Admits the waiting sequences of job `id` in order; true when none is left waiting (or the job is gone),
    /// false when a slot or the pool's context is lacking.
    fn admit_from(&mut self, id: u64) -> bool {
        // The sequence admitted last in this pass still has its prompt ahead: the next one with the same prompt
        // follows it instead of prefilling the prompt again.
        let mut leader: Option<Slot> = None;
        loop {
            let Some(active) = self.jobs.get(&id) else {
                return true;
            };
            let Some(spec) = active.waiting.front() else {
                return true;
            };
            let Some(slot) = self.free_slot() else {
                return false;
            };
            let follows = leader.filter(|&l| {
                self.slots[l].as_ref().is_some_and(|lead| {
                    Arc::ptr_eq(&lead.spec.prompt, &spec.prompt)
                        && lead.spec.request.prompt_logprobs == spec.request.prompt_logprobs
                })
            });
            let (prompt, grant, caches) = (
                spec.prompt.clone(),
                first_grant(spec, self.options.grant_ahead),
                self.caches(spec),
            );
            let started = Instant::now();
            let hashes = (follows.is_none() && caches).then(|| PrefixHashes::new(&prompt));
            let hashed = started.elapsed();
            let cached = match &hashes {
                Some(hashes) => self.cache.lookup_hashed(&prompt, hashes, prompt.len() - 1),
                None => None,
            };
            let looked_up = started.elapsed();
            let restored = match self.take_room(slot, grant, cached) {
                Ok(Some(restored)) => restored,
                Ok(None) => return false,
                Err(e) => {
                    self.fail_job(id, forward_error(e));
                    return true;
                }
            };
            let spec = self
                .jobs
                .get_mut(&id)
                .and_then(|a| a.waiting.pop_front())
                .expect("the sequence just looked at");
            let phase = match follows {
                Some(leader) => Phase::Follow { leader },
                None => Phase::Prefill { done: restored },
            };
            let mut seq = self.new_seq(id, spec, phase);
            seq.cached = restored;
            seq.granted = grant;
            if hashes.is_some() {
                seq.snapshot_at = self.snapshot_points(&seq.spec.prompt);
                seq.prompt_hashes = hashes;
            }
            if let Some(active) = self.jobs.get(&id) {
                tracing::debug!(
                    since_arrival_ms = (started - active.job.arrived).as_secs_f64() * 1e3,
                    ms = started.elapsed().as_secs_f64() * 1e3,
                    hash_ms = hashed.as_secs_f64() * 1e3,
                    lookup_ms = (looked_up - hashed).as_secs_f64() * 1e3,
                    cached = restored,
                    "admitted: prefix looked up, state restored"
                );
            }
            self.slots[slot] = Some(seq);
            if follows.is_none() {
                leader = Some(slot);
            }
        }
    }

    /// Admits the preempted sequences again, the earliest admitted first, each starting from the prefix cache's
    /// longest snapshot of its tokens. True when none is left waiting: until then no new sequence enters, so that
    /// the sequences that gave way go on first.
    fn resume_preempted(&mut self) -> bool {
        while let Some(i) = (0..self.preempted.len()).min_by_key(|&i| self.preempted[i].order) {
            let Some(slot) = self.free_slot() else {
                return false;
            };
            let seq = &self.preempted[i];
            let grant = first_grant(&seq.spec, self.options.grant_ahead);
            let prompt = &seq.spec.prompt;
            let cached = match &seq.prompt_hashes {
                Some(hashes) => self.cache.lookup_hashed(prompt, hashes, prompt.len() - 1),
                None => None,
            };
            match self.take_room(slot, grant, cached) {
                Ok(Some(restored)) => {
                    let mut seq = self.preempted.swap_remove(i);
                    seq.phase = Phase::Prefill { done: restored };
                    seq.granted = grant;
                    if !seq.resumed {
                        seq.cached = restored;
                    }
                    tracing::debug!(tokens = seq.spec.prompt.len(), restored, "resumed a preempted sequence");
                    self.slots[slot] = Some(seq);
                }
                Ok(None) => return false,
                Err(e) => {
                    let job = self.preempted[i].job;
                    self.fail_job(job, forward_error(e));
                }
            }
        }
        true
    }

    /// Takes the sequence in `slot` out of its slot and gives its context back to the pool, for older sequences
    /// to grow. It waits in `preempted` to be prefilled again: a sequence still in its prompt from the start, one
    /// that was decoding from its prompt and every token it generated, the one not in the slot yet included, which
    /// gives the logits its next step would have given. It keeps its output, sampler, constraint and history, so
    /// its client receives the tokens that follow the same way, only later. (On a GPU the recomputed state differs
    /// from the stepped one by rounding, as any prefill's does from steps', so a later token may differ where two
    /// were all but tied.)
    fn preempt(&mut self, slot: Slot) {
        let Some(mut seq) = self.slots[slot].take() else {
            return;
        };
        self.backend.release(slot);
        if !seq.generated.is_empty() {
            let mut tokens = Vec::with_capacity(seq.spec.prompt.len() + seq.generated.len());
            tokens.extend_from_slice(&seq.spec.prompt);
            tokens.extend_from_slice(&seq.generated);
            seq.spec.max_tokens = seq.spec.max_tokens.saturating_sub(seq.generated.len());
            seq.spec.prompt = Arc::new(tokens);
            seq.generated.clear();
            seq.resumed = true;
            // Its prompt's logprobs were sent, so the cache serves it too.
            let caches = self.options.prefix_cache;
            seq.prompt_hashes = caches.then(|| PrefixHashes::new(&seq.spec.prompt));
            seq.snapshot_at = match caches {
                true => self.snapshot_points(&seq.spec.prompt),
                false => Vec::new(),
            };
        }
        seq.granted = 0;
        seq.phase = Phase::Prefill { done: 0 };
        tracing::debug!(tokens = seq.spec.prompt.len(), "preempted a sequence: the pool is full");
        self.shared.metrics.preemptions.increment(1);
        self.preempted.push(seq);
        self.set_running();
    }

    /// The sequence admitted last among those that can give way when the pool runs out: a decoding one, or one
    /// prefilling its prompt that no other waits to be forked from (one echoing its prompt's logprobs goes on).
    fn youngest_preemptable(&self) -> Option<Slot> {
        let leads =
            |s: Slot| (self.slots.iter().flatten()).any(|q| matches!(q.phase, Phase::Follow { leader } if leader == s));
        (0..self.slots.len())
            .filter(|&s| match &self.slots[s] {
                Some(q) => match q.phase {
                    Phase::Decode { .. } => true,
                    Phase::Prefill { .. } => !leads(s),
                    _ => false,
                },
                None => false,
            })
            .max_by_key(|&s| self.slots[s].as_ref().map_or(0, |q| q.order))
    }

    /// The context the sequence in `slot` is to be granted when its grant is used up: its length, the next token
    /// and up to `grant_ahead - 1` more, at most its prompt plus `max_tokens`.
    fn next_grant(&self, slot: Slot, seq: &Seq) -> usize {
        let len = self.backend.len(slot);
        seq.spec.work().min(len + self.options.grant_ahead).max(len + 1)
    }

    /// Grants the sequence in `slot` context for one token more than it holds where its grant is used up: up to
    /// `grant_ahead` tokens more, as the pool has them. False when the pool lacks them, or when the backend
    /// failed (its job failed with it).
    fn grant_step(&mut self, slot: Slot) -> bool {
        let Some(seq) = self.slots[slot].as_ref() else {
            return false;
        };
        if self.backend.len(slot) < seq.granted {
            return true;
        }
        let (job, grant) = (seq.job, self.next_grant(slot, seq));
        match self.backend.reserve(slot, grant) {
            Ok(true) => {
                self.slots[slot].as_mut().expect("looked at above").granted = grant;
                true
            }
            Ok(false) => false,
            Err(e) => {
                self.fail_job(job, forward_error(e));
                false
            }
        }
    }

    /// Grants each sequence in `chosen` (about to step) context for its next token, the earliest admitted first.
    /// Where the pool lacks it, the prefix cache's snapshots go first, least recently used first, while dropping
    /// them all could make the room (a snapshot that shares its pages with a running sequence returns nothing);
    /// then the sequences admitted last are preempted, down to the sequence itself. Returns the slots still to step.
    fn grant_steps(&mut self, chosen: Vec<Slot>) -> Vec<Slot> {
        let mut by_age = chosen.clone();
        by_age.sort_by_key(|&s| self.slots[s].as_ref().map_or(u64::MAX, |q| q.order));
        for slot in by_age {
            while self.slots[slot].is_some() && !self.grant_step(slot) {
                // A sequence whose job failed has left its slot.
                let Some(seq) = self.slots[slot].as_ref() else {
                    break;
                };
                let (job, needed) = (seq.job, self.next_grant(slot, seq).saturating_sub(seq.granted));
                if self.backend.free_tokens() + self.backend.snapshot_tokens() >= needed {
                    if let Some(victim) = self.cache.evict() {
                        self.backend.drop_snapshot(victim);
                        self.shared.metrics.prefix_cache_evictions.increment(1);
                        self.cache_gauges();
                        continue;
                    }
                }
                match self.youngest_preemptable() {
                    Some(victim) => self.preempt(victim),
                    // Only a sequence echoing its prompt could be short (none is: each is granted its prompt and
                    // more at admission), and nothing is left to take back; failing it beats a loop.
                    None => self.fail_job(job, ApiError::internal("the context pool could not hold the sequence")),
                }
            }
        }
        chosen.into_iter().filter(|&s| self.slots[s].is_some()).collect()
    }

    /// Whether the sequence uses the prefix cache: not when it asks for its prompt's logprobs, which need every
    /// position's logits.
    fn caches(&self, spec: &SequenceSpec) -> bool {
        self.options.prefix_cache && spec.request.prompt_logprobs.is_none() && !spec.prompt.is_empty()
    }

    /// Where a prefill of `prompt` stops to snapshot, ascending: before the first and the last message of a
    /// rendered chat (the end of a shared system prompt, and the end of the conversation before the reply the
    /// prompt asks for, which is where the next turn's prompt starts to differ) and every `snapshot_interval`
    /// tokens; at most `MAX_SNAPSHOTS_PER_PROMPT`, the first and the latest kept. The prompt's end is snapshotted
    /// as well, after its last chunk.
    fn snapshot_points(&self, prompt: &[u32]) -> Vec<usize> {
        let n = prompt.len();
        if n < 2 {
            return Vec::new();
        }
        let boundaries: Vec<usize> = match self.message_start {
            Some(start) => (1..n).filter(|&i| prompt[i] == start).collect(),
            None => Vec::new(),
        };
        // The boundaries between, where earlier turns of a conversation already left snapshots, would each cost a
        // prefill call of their own for little use.
        let mut points: Vec<usize> = boundaries
            .first()
            .into_iter()
            .chain(boundaries.last())
            .copied()
            .collect();
        if self.options.snapshot_interval > 0 {
            points.extend((1..n).filter(|i| i % self.options.snapshot_interval == 0));
        }
        points.sort_unstable();
        points.dedup();
        if points.len() > MAX_SNAPSHOTS_PER_PROMPT {
            let first = points[0];
            let latest = points.split_off(points.len() - (MAX_SNAPSHOTS_PER_PROMPT - 1));
            points = std::iter::once(first).chain(latest).collect();
            points.dedup();
        }
        points
    }

    /// Gives the empty `slot` room for `tokens` positions, starting it from snapshot `from` (its id and length)
    /// when given. Returns the tokens the slot holds then (the snapshot's length, or 0), or `None` when the pool
    /// lacks the room. When dropping cached snapshots can make the room, the least recently used go first.
    fn take_room(
        &mut self,
        slot: Slot,
        tokens: usize,
        from: Option<(SnapshotId, usize)>,
    ) -> Result<Option<usize>, ForwardError> {
        let mut from = from;
        let mut evicting = false;
        loop {
            let done = match from {
                Some((id, len)) => self.backend.restore(id, slot, tokens)?.then_some(len),
                None => self.backend.reserve(slot, tokens)?.then_some(0),
            };
            if done.is_some() {
                return Ok(done);
            }
            // Dropping snapshots only helps when what they hold, with what is free, covers the request; otherwise
            // the sequence waits for running ones to finish, and the cache stays.
            if !evicting && self.backend.free_tokens() + self.backend.snapshot_tokens() < tokens {
                return Ok(None);
            }
            evicting = true;
            let Some(victim) = self.cache.evict_except(from.map(|(id, _)| id)) else {
                return Ok(None);
            };
            if from.is_some_and(|(id, _)| id == victim) {
                from = None;
            }
            self.backend.drop_snapshot(victim);
            self.shared.metrics.prefix_cache_evictions.increment(1);
            self.cache_gauges();
        }
    }

    /// Snapshots the sequence in `slot`, whose tokens so far are `tokens` (of prefix-cache hash `hash`), into the
    /// prefix cache unless an equal one is there; drops the least recently used snapshots while the backend has no
    /// room for it.
    fn save_snapshot(&mut self, slot: Slot, tokens: &[u32], hash: u64) {
        if tokens.is_empty() || self.cache.contains_hashed(tokens, hash) {
            return;
        }
        loop {
            match self.backend.snapshot(slot) {
                Ok(Some(id)) => {
                    self.cache.insert_hashed(id, tokens, hash);
                    break;
                }
                Ok(None) => {
                    let Some(victim) = self.cache.evict() else {
                        break;
                    };
                    self.backend.drop_snapshot(victim);
                    self.shared.metrics.prefix_cache_evictions.increment(1);
                }
                Err(e) => {
                    tracing::warn!("prefix cache: snapshot failed: {e}");
                    break;
                }
            }
        }
        self.cache_gauges();
    }

    /// Makes room for up to `wanted` more snapshots, dropping the least recently used while the backend has too
    /// few; returns how many fit (fewer once the cache has nothing left to drop).
    fn make_snapshot_room(&mut self, wanted: usize) -> usize {
        while self.backend.snapshot_room() < wanted {
            let Some(victim) = self.cache.evict() else {
                break;
            };
            self.backend.drop_snapshot(victim);
            self.shared.metrics.prefix_cache_evictions.increment(1);
        }
        wanted.min(self.backend.snapshot_room())
    }

    /// The prefix-cache hash of the first `len` prompt tokens of the sequence in `slot`, if it uses the cache.
    fn prompt_hash(&self, slot: Slot, len: usize) -> Option<u64> {
        Some(self.slots[slot].as_ref()?.prompt_hashes.as_ref()?.of(len))
    }

    /// Whether the prefix cache holds the first `len` prompt tokens of `seq` (a sequence that uses the cache).
    fn cached_prefix(&self, seq: &Seq, len: usize) -> bool {
        let hashes = seq.prompt_hashes.as_ref();
        hashes.is_some_and(|h| self.cache.contains_hashed(&seq.spec.prompt[..len], h.of(len)))
    }

    fn cache_gauges(&self) {
        let m = &self.shared.metrics;
        m.prefix_cache_snapshots.set(self.cache.len() as f64);
        m.prefix_cache_bytes.set(self.backend.snapshot_bytes() as f64);
    }

    fn new_seq(&mut self, job: u64, spec: SequenceSpec, phase: Phase) -> Seq {
        let request = spec.request.clone();
        let options = OutputOptions {
            eos_token_ids: if request.ignore_eos {
                Vec::new()
            } else {
                self.eos.clone()
            },
            stop_strings: request.stop.clone(),
            max_tokens: Some(spec.max_tokens),
            tools: match &request.kind {
                OutputKind::Chat { tools } => tools.clone(),
                OutputKind::Text => Vec::new(),
            },
            call_ids: self.call_ids,
        };
        let output = match request.kind {
            OutputKind::Chat { .. } => OutputStream::new(self.tokenizer.clone(), &spec.prompt_text, options),
            OutputKind::Text => OutputStream::raw(self.tokenizer.clone(), options),
        };
        // A chat output that starts inside the prompt's think block is constrained only after `</think>`.
        let in_reasoning = match request.kind {
            OutputKind::Chat { .. } => lily_chat::ReasoningParser::for_prompt(&spec.prompt_text).in_reasoning(),
            OutputKind::Text => false,
        };
        let order = self.next_order;
        self.next_order += 1;
        Seq {
            job,
            order,
            phase,
            cached: 0,
            granted: 0,
            resumed: false,
            snapshot_at: Vec::new(),
            prompt_hashes: None,
            generated: Vec::new(),
            output,
            sampler: Sampler::new(spec.sampling.clone()),
            history: History::new(&spec.prompt, &request.penalties),
            constraint: request.constraint.as_ref().map(|g| Constraint::new(g, in_reasoning)),
            last_token_at: None,
            spec,
        }
    }

    /// Prefills chunks of the earliest admitted prompts within the iteration's budget; true when there was one.
    fn prefill_chunks(&mut self) -> bool {
        let mut left = self.options.max_prefill_tokens.unwrap_or(1);
        let mut calls = 0;
        while left > 0 && calls < PREFILL_CALLS_PER_ITERATION {
            let Some(tokens) = self.prefill_call(left) else {
                break;
            };
            calls += 1;
            left = left.saturating_sub(tokens);
        }
        calls > 0
    }

    /// The slots of sequences whose prompt is being prefilled, earliest admitted first.
    fn prefill_order(&self) -> Vec<Slot> {
        let mut order: Vec<(u64, Slot)> = (0..self.slots.len())
            .filter_map(|s| match &self.slots[s] {
                Some(
                    seq @ Seq {
                        phase: Phase::Prefill { .. },
                        ..
                    },
                ) => Some((seq.order, s)),
                _ => None,
            })
            .collect();
        order.sort_unstable();
        order.into_iter().map(|(_, s)| s).collect()
    }

    /// Makes one prefill call of at most `limit` tokens: a chunk of the earliest admitted prompt, joined by chunks
    /// of the prompts admitted after it where the backend takes several sequences a call, so that one pass reads
    /// the weights for all of them. Returns its tokens, `None` when no prompt waits.
    fn prefill_call(&mut self, limit: usize) -> Option<usize> {
        let order = self.prefill_order();
        let first = *order.first()?;
        let Some(chunk) = self.plan_chunk(first, limit, 0) else {
            return Some(0);
        };
        let limit = limit.min(self.backend.max_prefill_tokens().max(1));
        let max_parts = self.backend.max_prefill_parts();
        let mut chunks = vec![chunk];
        // A chunk that echoes its prompt's logprobs goes alone; others join the call while the budget lasts. One
        // that could start from a snapshot a chunk in the call leaves waits for the prefix cache to give it that
        // part instead.
        let joinable = |c: &Chunk| c.echo.is_none();
        if joinable(&chunks[0]) {
            for &slot in &order[1..] {
                // A slot emptied while this call was planned belonged to a job that failed.
                if self.slots[slot].is_none() {
                    continue;
                }
                let used: usize = chunks.iter().map(|c| c.end - c.done).sum();
                if chunks.len() >= max_parts || used >= limit || self.would_share(slot, &chunks) {
                    break;
                }
                let taken = chunks.iter().map(|c| c.cuts.len()).sum();
                match self.plan_chunk(slot, limit - used, taken) {
                    Some(chunk) if joinable(&chunk) => chunks.push(chunk),
                    Some(_) => break,
                    // The job failed (a restore that failed), and its sequences are gone: so are their chunks.
                    None => chunks.retain(|c| self.slots[c.slot].is_some()),
                }
            }
        }
        if chunks.is_empty() {
            return Some(0);
        }
        let tokens = chunks.iter().map(|c| c.end - c.done).sum();
        self.run_chunks(chunks);
        Some(tokens)
    }

    /// Whether, with the prefix cache on, the prompt in `slot` could start from a snapshot that a sequence in
    /// `chunks` leaves (at one of its snapshot points or its prompt's end, within the prefix the two prompts share
    /// and past what the slot holds): prefilled in the same call, that shared part would be computed twice, so the
    /// sequence waits for the cache instead.
    fn would_share(&self, slot: Slot, chunks: &[Chunk]) -> bool {
        let Some(seq) = self.slots[slot].as_ref() else {
            return false;
        };
        let Phase::Prefill { done } = seq.phase else {
            return false;
        };
        let prompt = &seq.spec.prompt;
        seq.prompt_hashes.is_some()
            && chunks.iter().any(|c| {
                let other = self.slots[c.slot].as_ref().expect("a planned sequence");
                let shared = prompt
                    .iter()
                    .zip(other.spec.prompt.iter())
                    .take_while(|(a, b)| a == b)
                    .count();
                other.prompt_hashes.is_some()
                    && (other.snapshot_at.iter().copied())
                        .chain([other.spec.prompt.len()])
                        .any(|p| p > done && p <= shared && p < prompt.len())
            })
    }

    /// Plans the next prefill call's part of the prompt in `slot`, at most `limit` tokens: where it starts (after
    /// what the prefix cache can give it now), where it ends and the snapshots it takes. Where the backend
    /// snapshots inside a pass, the snapshot points before its end are taken in it while the backend has room for
    /// them beside the `taken` that the call's earlier parts take; otherwise, or past them, it ends at the next
    /// point. `None` when the job failed.
    fn plan_chunk(&mut self, slot: Slot, limit: usize, taken: usize) -> Option<Chunk> {
        let seq = self.slots[slot].as_ref().expect("a sequence in prefill");
        let Phase::Prefill { mut done } = seq.phase else {
            unreachable!("chosen for its phase")
        };
        // A resumed sequence's prompt logprobs were sent before it was preempted.
        let echo = seq.spec.request.prompt_logprobs.filter(|_| !seq.resumed);
        let job = seq.job;
        if seq.prompt_hashes.is_some() {
            // A sequence admitted earlier may have cached more of this prompt since: start from there instead.
            match self.catch_up(slot, done) {
                Ok(restored) => done = restored,
                Err(e) => {
                    self.fail_job(job, forward_error(e));
                    return None;
                }
            }
        }
        let seq = self.slots[slot].as_ref().expect("a sequence in prefill");
        let len = seq.spec.prompt.len();
        let reach = len
            .min(done + limit.max(1))
            .min(done + self.backend.max_prefill_tokens().max(1));
        // The snapshot points this call reaches whose prefix the cache lacks.
        let points: Vec<usize> = seq
            .snapshot_at
            .iter()
            .copied()
            .filter(|&p| p > done && p <= reach && !self.cached_prefix(seq, p))
            .collect();
        let inside = points.iter().filter(|&&p| p < reach).count();
        let cuts = match self.backend.snapshots_in_prefill() {
            true => self.make_snapshot_room(taken + inside).saturating_sub(taken),
            false => 0,
        };
        let end = points.get(cuts).copied().unwrap_or(reach);
        let cuts: Vec<usize> = points[..cuts].iter().map(|&p| p - done).collect();
        // A prompt whose logprobs are asked for enters one token at a time (its first token here, the others in
        // steps), so that every position's logits come out of the forward pass that generation uses.
        let (cuts, end) = match echo {
            Some(_) => (Vec::new(), 1),
            None => (cuts, end),
        };
        Some(Chunk {
            slot,
            job,
            done,
            end,
            cuts,
            echo,
        })
    }

    /// Runs the chunks of one prefill call (one sequence's, or several joined) and takes their results: a chunk
    /// that echoes its prompt (always alone) goes on in steps, the others move their sequences on.
    fn run_chunks(&mut self, chunks: Vec<Chunk>) {
        let prompts: Vec<Arc<Vec<u32>>> = chunks
            .iter()
            .map(|c| {
                self.slots[c.slot]
                    .as_ref()
                    .expect("a planned sequence")
                    .spec
                    .prompt
                    .clone()
            })
            .collect();
        let parts: Vec<PrefillPart<'_>> = chunks
            .iter()
            .zip(&prompts)
            .map(|(c, prompt)| PrefillPart {
                slot: c.slot,
                tokens: &prompt[c.done..c.end],
                cuts: &c.cuts,
            })
            .collect();
        let started = Instant::now();
        let result = self.backend.prefill_parts(&parts);
        self.trace_prefill(&chunks, started);
        let ids = match result {
            Ok(ids) => ids,
            Err(e) => {
                let error = forward_error(e);
                for c in &chunks {
                    self.fail_job(c.job, error.clone());
                }
                return;
            }
        };
        for ((chunk, prompt), ids) in chunks.iter().zip(&prompts).zip(ids) {
            self.cache_snapshots(chunk, prompt, ids);
        }
        let (mut ready, mut in_prompts) = (Vec::new(), Vec::new());
        for (row, chunk) in chunks.iter().enumerate() {
            // A sequence whose job an earlier part's handling failed has left its slot.
            if self.slots[chunk.slot].as_ref().is_none_or(|q| q.job != chunk.job) {
                continue;
            }
            if let Some(top) = chunk.echo.filter(|_| prompts[row].len() > 1) {
                self.start_echo(chunk, row, top);
                continue;
            }
            let done = self.chunk_done(chunk, row);
            ready.extend(done.ready);
            in_prompts.extend(done.prompts);
        }
        self.sample_and_emit(&ready);
        self.snapshot_prompts(in_prompts);
    }

    /// A chunk echoing its prompt's logprobs (its first token in, its logits in output `row`): the logprob of the
    /// prompt's second token, among the `top` most likely, and the sequence goes on one prompt token a step.
    fn start_echo(&mut self, chunk: &Chunk, row: usize, top: usize) {
        let seq = self.slots[chunk.slot].as_ref().expect("a planned sequence");
        let second = seq.spec.prompt[1];
        let entry = match self.backend.logits(row) {
            Ok(logits) => logits::logprobs(logits, second, top),
            Err(e) => return self.fail_job(chunk.job, forward_error(e)),
        };
        let seq = self.slots[chunk.slot].as_mut().expect("a planned sequence");
        seq.phase = Phase::Echo {
            next: 1,
            entries: vec![entry],
        };
    }

    /// Puts the snapshots a prefill call took at a chunk's cuts (`None` where the backend had no room) into the
    /// prefix cache.
    fn cache_snapshots(&mut self, chunk: &Chunk, prompt: &[u32], ids: Vec<Option<SnapshotId>>) {
        for (id, cut) in ids.into_iter().zip(&chunk.cuts) {
            if let Some(id) = id {
                let tokens = &prompt[..chunk.done + cut];
                match self.prompt_hash(chunk.slot, tokens.len()) {
                    Some(hash) => self.cache.insert_hashed(id, tokens, hash),
                    None => self.cache.insert(id, tokens),
                }
            }
        }
        self.cache_gauges();
    }

    fn trace_prefill(&self, chunks: &[Chunk], started: Instant) {
        let since_arrival_ms = |c: &Chunk| {
            self.jobs
                .get(&c.job)
                .map_or(0.0, |a| (started - a.job.arrived).as_secs_f64() * 1e3)
        };
        tracing::debug!(
            tokens = ?chunks.iter().map(|c| c.end - c.done).collect::<Vec<_>>(),
            cuts = ?chunks.iter().map(|c| c.cuts.len()).sum::<usize>(),
            since_arrival_ms = ?chunks.iter().map(since_arrival_ms).collect::<Vec<_>>(),
            ms = started.elapsed().as_secs_f64() * 1e3,
            "prefill call"
        );
    }

    /// Takes a chunk whose prefill is in (its next-token logits in output `row`): snapshots the prompt where the
    /// chunk ends at a snapshot point inside it, and moves the sequence on. Returns the sequences to sample, and
    /// the prompts that are in now, to be snapshotted once their first tokens are out.
    fn chunk_done(&mut self, chunk: &Chunk, row: usize) -> ChunkDone {
        let (slot, end) = (chunk.slot, chunk.end);
        let seq = self.slots[slot].as_ref().expect("a planned sequence");
        let prompt = seq.spec.prompt.clone();
        let snapshots = seq.prompt_hashes.is_some();
        let at_point = seq.snapshot_at.contains(&end);
        let snapshot = chunk.echo.is_none() && (at_point || (snapshots && end == prompt.len()));
        if end < prompt.len() {
            if let Some(hash) = self.prompt_hash(slot, end).filter(|_| snapshot) {
                self.save_snapshot(slot, &prompt[..end], hash);
            }
            let seq = self.slots[slot].as_mut().expect("a planned sequence");
            seq.phase = Phase::Prefill { done: end };
            return ChunkDone::default();
        }
        let order = seq.order;
        let ready = self.prompt_done(slot, Vec::new(), row);
        let prompts = match snapshot {
            true => vec![(slot, order, end)],
            false => Vec::new(),
        };
        ChunkDone { ready, prompts }
    }

    /// Snapshots each listed prompt (slot, the sequence's admission order, its prompt's length) whose first token
    /// is out: copying the sequence's state is no part of what the client waits for, and the slot holds that state
    /// until its next step. A sequence that finished with that token has been snapshotted as it finished.
    fn snapshot_prompts(&mut self, prompts: Vec<(Slot, u64, usize)>) {
        for (slot, order, end) in prompts {
            let Some(seq) = self.slots[slot].as_ref() else {
                continue;
            };
            let unchanged = seq.order == order && self.backend.len(slot) == end;
            let prompt = seq.spec.prompt[..end].to_vec();
            if let Some(hash) = self.prompt_hash(slot, end).filter(|_| unchanged) {
                self.save_snapshot(slot, &prompt, hash);
            }
        }
    }

    /// Restarts the sequence in `slot`, whose first `done` prompt tokens are in, from the prefix cache's snapshot of
    /// a longer prefix of its prompt when there is one. Returns the prompt tokens in the slot then.
    fn catch_up(&mut self, slot: Slot, done: usize) -> Result<usize, ForwardError> {
        let seq = self.slots[slot].as_ref().expect("a sequence in prefill");
        let prompt = seq.spec.prompt.clone();
        let grant = seq.granted;
        let Some(hashes) = &seq.prompt_hashes else {
            return Ok(done);
        };
        let found = self.cache.lookup_hashed(&prompt, hashes, prompt.len() - 1);
        let Some((id, len)) = found.filter(|&(_, len)| len > done) else {
            return Ok(done);
        };
        // The restore takes the same grant again, and giving the slot's back first makes room for it.
        self.backend.release(slot);
        let restored = match self.take_room(slot, grant, Some((id, len)))? {
            Some(restored) => restored,
            None => {
                return Err(ForwardError::Device(
                    "the pool could not hold a sequence it held before".into(),
                ))
            }
        };
        let seq = self.slots[slot].as_mut().expect("a sequence in prefill");
        if !seq.resumed {
            seq.cached = restored;
        }
        seq.phase = Phase::Prefill { done: restored };
        Ok(restored)
    }

    /// The prompt of the sequence in `slot` is in, its next-token logits in output `row`: counts it, sends its
    /// prompt logprobs (`entries`) where asked, and forks it into its followers' slots. Returns the sequences to
    /// sample from `row`: it and its followers (none when the job failed), except those that ask for no tokens,
    /// which finish here.
    fn prompt_done(&mut self, slot: Slot, entries: Vec<TokenLogprob>, row: usize) -> Vec<(Slot, usize)> {
        let seq = self.slots[slot].as_mut().expect("a sequence whose prompt is in");
        seq.phase = Phase::Ready;
        let job = seq.job;
        let followers: Vec<Slot> = (0..self.slots.len())
            .filter(|&f| matches!(self.slots[f], Some(Seq { phase: Phase::Follow { leader }, .. }) if leader == slot))
            .collect();
        for &f in &followers {
            if let Err(e) = self.backend.fork(slot, f) {
                self.fail_job(job, forward_error(e));
                return Vec::new();
            }
            self.slots[f].as_mut().expect("a follower").phase = Phase::Ready;
        }
        let mut ready = Vec::with_capacity(followers.len() + 1);
        let mut done = Vec::new();
        for s in std::iter::once(slot).chain(followers) {
            let seq = self.slots[s].as_ref().expect("a sequence whose prompt is in");
            if seq.resumed {
                ready.push((s, row));
                continue;
            }
            let metrics = &self.shared.metrics;
            metrics.prompt_tokens.increment(seq.spec.prompt.len() as u64);
            if seq.prompt_hashes.is_some() {
                metrics.prefix_cache_queries.increment(1);
                metrics
                    .prefix_cache_query_tokens
                    .increment(seq.spec.prompt.len() as u64);
                if seq.cached > 0 {
                    metrics.prefix_cache_hits.increment(1);
                    metrics.prefix_cache_hit_tokens.increment(seq.cached as u64);
                }
            }
            let wants_none = seq.spec.max_tokens == 0;
            if seq.spec.request.prompt_logprobs.is_some() {
                let event = Event::PromptLogprobs {
                    index: seq.spec.index,
                    first_token: seq.spec.prompt[0],
                    logprobs: entries.clone(),
                };
                if self.send(job, event).is_err() {
                    return Vec::new();
                }
            }
            if wants_none {
                // A sequence that asks for no tokens (a completion that echoes its prompt to score it) is done.
                done.push(s);
            } else {
                ready.push((s, row));
            }
        }
        for s in done {
            self.finish_seq(s);
        }
        ready
    }

    /// Sends an event to job `id`'s client; a client that is gone cancels the job.
    fn send(&mut self, id: u64, event: Event) -> Result<(), ()> {
        let Some(active) = self.jobs.get(&id) else {
            return Err(());
        };
        if active.job.events.send(event).is_err() {
            self.cancel_job(id);
            return Err(());
        }
        Ok(())
    }

    /// One step over the sequences with a token to append (at most `max_step_rows` of them, taking turns when
    /// there are more); true when there was one.
    fn decode_step(&mut self) -> bool {
        let ready: Vec<Slot> = (0..self.slots.len())
            .filter(|&s| {
                matches!(
                    self.slots[s],
                    Some(Seq {
                        phase: Phase::Decode { .. } | Phase::Echo { .. },
                        ..
                    })
                )
            })
            .collect();
        if ready.is_empty() {
            return false;
        }
        let take = ready.len().min(self.backend.max_step_rows().max(1));
        let start = self.step_start % ready.len();
        let chosen: Vec<Slot> = ready.iter().cycle().skip(start).take(take).copied().collect();
        self.step_start = self.step_start.wrapping_add(take);
        let chosen = self.grant_steps(chosen);
        if chosen.is_empty() {
            // Every chosen sequence was preempted or failed: that was this iteration's work.
            return true;
        }
        let rows: Vec<StepRow> = chosen
            .iter()
            .map(|&slot| {
                let seq = self.slots[slot].as_ref().expect("chosen above");
                let token = match seq.phase {
                    Phase::Decode { token } => token,
                    Phase::Echo { next, .. } => seq.spec.prompt[next],
                    _ => unreachable!("chosen for its phase"),
                };
                StepRow { slot, token }
            })
            .collect();
        let started = Instant::now();
        if !self.step(&rows) {
            return true;
        }
        let mut to_sample = Vec::with_capacity(chosen.len());
        for (row, &slot) in chosen.iter().enumerate() {
            let Some(seq) = self.slots[slot].as_mut() else {
                continue;
            };
            match &mut seq.phase {
                Phase::Decode { .. } => to_sample.push((slot, row)),
                Phase::Echo { next, entries } => {
                    // The step appended prompt token `next`; its logits give the next prompt token's logprob, or,
                    // after the prompt's last token, the first generated token.
                    let appended = *next;
                    if appended + 1 >= seq.spec.prompt.len() {
                        let entries = std::mem::take(entries);
                        to_sample.extend(self.prompt_done(slot, entries, row));
                        continue;
                    }
                    let following = seq.spec.prompt[appended + 1];
                    let top = seq.spec.request.prompt_logprobs.unwrap_or(0);
                    let job = seq.job;
                    match self.backend.logits(row) {
                        Ok(logits) => {
                            let entry = logits::logprobs(logits, following, top);
                            if let Some(Seq {
                                phase: Phase::Echo { next, entries },
                                ..
                            }) = self.slots[slot].as_mut()
                            {
                                entries.push(entry);
                                *next = appended + 1;
                            }
                        }
                        Err(e) => self.fail_job(job, forward_error(e)),
                    }
                }
                _ => {}
            }
        }
        let launched = Instant::now();
        self.finish_step(&to_sample, rows.len(), started, launched);
        true
    }

    /// Queues a step of `rows` on the backend; where that fails, the jobs of its rows fail with it. True when queued.
    fn step(&mut self, rows: &[StepRow]) -> bool {
        let Err(e) = self.backend.step(rows) else {
            return true;
        };
        let error = forward_error(e);
        let jobs: Vec<u64> = rows
            .iter()
            .filter_map(|r| self.slots[r.slot].as_ref().map(|q| q.job))
            .collect();
        for job in jobs {
            self.fail_job(job, error.clone());
        }
        false
    }

    /// Takes the tokens of the step queued ahead: its rows whose sequence is still in its slot.
    fn finish_queued(&mut self, queued: QueuedStep) {
        let to_sample: Vec<(Slot, usize)> = queued
            .rows
            .iter()
            .enumerate()
            .filter_map(|(row, &(slot, order))| {
                let seq = self.slots[slot].as_ref()?;
                (seq.order == order && matches!(seq.phase, Phase::Decode { .. })).then_some((slot, row))
            })
            .collect();
        self.finish_step(&to_sample, queued.rows.len(), queued.started, queued.launched);
    }

    /// Chooses the tokens of a step queued over `started .. launched`, queues the next step when nothing else
    /// waits for the backend, and then sends what the tokens released, so that on a GPU this host work overlaps
    /// the next step.
    fn finish_step(&mut self, to_sample: &[(Slot, usize)], rows: usize, started: Instant, launched: Instant) {
        let (chosen, sample_time) = self.choose(to_sample);
        let chose = Instant::now();
        let ahead = self.step_ahead(&chosen);
        let emitting = Instant::now();
        self.emit(chosen);
        // Where a step's time goes on the host: queuing it, waiting for its tokens (the device's time shows
        // here), handling them, and the time between steps (prefill calls and admission included); `ahead` when
        // the next step was queued before the handling.
        let done = Instant::now();
        let us = |d: Duration| d.as_micros() as u64;
        tracing::trace!(
            rows,
            launch_us = us(launched - started),
            sample_us = us(sample_time),
            emit_us = us((chose - launched).saturating_sub(sample_time) + (done - emitting)),
            between_us = self.last_step_done.map(|t| us(started.saturating_duration_since(t))),
            ahead,
            "decode step"
        );
        self.last_step_done = Some(done);
    }

    /// Queues the next step before the tokens just chosen are handled (detokenized, checked for stops, sent), when
    /// the backend runs steps asynchronously and the next iteration would do nothing but that step: every sequence
    /// decodes, and no job waits to be admitted or none could be (every slot taken, none freed by these tokens).
    /// Its rows are every sequence but those that these tokens end (an end-of-sequence token, the last of
    /// `max_tokens`); one that a stop string ends takes its row in vain, the row is passed over, and a job waiting
    /// for its slot is admitted a step later. True when it queued one.
    fn step_ahead(&mut self, chosen: &[(Slot, u32, Option<TokenLogprob>)]) -> bool {
        if !self.backend.queues_steps() {
            return false;
        }
        let waiting = self.admitting.is_some() || !self.preempted.is_empty() || !self.shared.queue.is_empty();
        for &(slot, token, _) in chosen {
            if let Some(seq) = self.slots[slot].as_mut() {
                seq.phase = Phase::Decode { token };
            }
        }
        // No step is queued now, so the slots of cancelled jobs can be freed here: in a run of steps queued ahead
        // the iteration's own check does not come.
        self.drop_cancelled();
        let mut rows = Vec::new();
        let mut queued = Vec::new();
        for (slot, entry) in self.slots.iter().enumerate() {
            let Some(seq) = entry else {
                continue;
            };
            let Phase::Decode { token } = seq.phase else {
                return false;
            };
            if !seq.output.would_end(token) {
                rows.push(StepRow { slot, token });
                queued.push((slot, seq.order));
            }
        }
        if rows.is_empty() || rows.len() > self.backend.max_step_rows() {
            return false;
        }
        let ending = self.slots.iter().flatten().count() > rows.len();
        if waiting && (ending || self.free_slot().is_some()) {
            return false;
        }
        // Where a grant is used up and the pool lacks more, the next iteration's step preempts.
        if !rows.iter().all(|r| self.grant_step(r.slot)) {
            return false;
        }
        let started = Instant::now();
        if !self.step(&rows) {
            return false;
        }
        self.ahead = Some(QueuedStep {
            rows: queued,
            started,
            launched: Instant::now(),
        });
        true
    }

    /// Chooses the next token of each listed sequence from its output row, and sends what it released. Returns
    /// how long the backend's sampling call took (it waits for the step on a GPU).
    fn sample_and_emit(&mut self, ready: &[(Slot, usize)]) -> Duration {
        let (chosen, sample_time) = self.choose(ready);
        self.emit(chosen);
        sample_time
    }

    /// Chooses the next token of each listed sequence (slot, output row), with its logprob where asked; a
    /// sequence whose choice failed fails its job. Returns the choices and how long the backend's sampling call
    /// took (it waits for the step on a GPU).
    #[allow(clippy::type_complexity)]
    fn choose(&mut self, ready: &[(Slot, usize)]) -> (Vec<(Slot, u32, Option<TokenLogprob>)>, Duration) {
        let mut sample_time = Duration::ZERO;
        if ready.is_empty() {
            return (Vec::new(), sample_time);
        }
        let mut chosen: Vec<(Slot, u32, Option<TokenLogprob>)> = Vec::with_capacity(ready.len());
        let mut failed: Vec<(u64, ApiError)> = Vec::new();
        // Sequences with penalties, logit bias or logprobs work on a copy of their logits on the host.
        for &(slot, row) in ready {
            let Some(seq) = self.slots[slot].as_mut() else {
                continue;
            };
            if !seq.spec.request.needs_host_logits() {
                continue;
            }
            let request = seq.spec.request.clone();
            // The constraint's mask depends only on the tokens so far, so it is computed first, while a GPU
            // still runs the step queued last; reading the logits then waits for that step.
            let mask = match seq.constraint.as_mut().map(|c| c.mask()).transpose() {
                Ok(mask) => mask.flatten(),
                Err(e) => {
                    failed.push((seq.job, ApiError::internal(e.to_string())));
                    continue;
                }
            };
            let logits = match self.backend.logits(row) {
                Ok(logits) => logits,
                Err(e) => {
                    failed.push((seq.job, forward_error(e)));
                    continue;
                }
            };
            self.scratch.clear();
            self.scratch.extend_from_slice(logits);
            logits::apply(&mut self.scratch, &request.penalties, &seq.history);
            // Logprobs are the model's, before the mask: the masked copy is a second buffer then.
            let token = match mask {
                Some(mask) if request.logprobs.is_some() => {
                    self.masked.clear();
                    self.masked.extend_from_slice(&self.scratch);
                    seq.sampler.sample_masked(&mut self.masked, mask)
                }
                Some(mask) => seq.sampler.sample_masked(&mut self.scratch, mask),
                None => seq.sampler.sample(&self.scratch),
            };
            let logprob = request.logprobs.map(|top| logits::logprobs(&self.scratch, token, top));
            chosen.push((slot, token, logprob));
        }
        // The others are sampled by the backend, where the logits are, constrained ones through their mask.
        let mut pick_slots = Vec::new();
        let mut row_of = vec![None; self.slots.len()];
        for &(slot, row) in ready {
            row_of[slot] = Some(row);
        }
        let result = {
            let mut picks = Vec::new();
            for (slot, entry) in self.slots.iter_mut().enumerate() {
                let Some(seq) = entry.as_mut() else {
                    continue;
                };
                let Some(row) = row_of[slot] else {
                    continue;
                };
                if seq.spec.request.needs_host_logits() {
                    continue;
                }
                let allowed = match seq.constraint.as_mut().map(|c| c.mask()).transpose() {
                    Ok(mask) => mask.flatten(),
                    Err(e) => {
                        failed.push((seq.job, ApiError::internal(e.to_string())));
                        continue;
                    }
                };
                picks.push(Pick {
                    row,
                    sampler: &mut seq.sampler,
                    allowed,
                });
                pick_slots.push(slot);
            }
            if picks.is_empty() {
                Ok(Vec::new())
            } else {
                let started = Instant::now();
                let tokens = self.backend.sample(&mut picks);
                sample_time = started.elapsed();
                tokens
            }
        };
        match result {
            Ok(tokens) => chosen.extend(pick_slots.iter().zip(tokens).map(|(&slot, token)| (slot, token, None))),
            Err(e) => {
                let error = forward_error(e);
                for &slot in &pick_slots {
                    if let Some(seq) = &self.slots[slot] {
                        failed.push((seq.job, error.clone()));
                    }
                }
            }
        }
        for (job, error) in failed {
            self.fail_job(job, error);
        }
        (chosen, sample_time)
    }

    /// Takes each chosen token as its sequence's next ([`Engine::emit_token`]).
    fn emit(&mut self, chosen: Vec<(Slot, u32, Option<TokenLogprob>)>) {
        for (slot, token, logprob) in chosen {
            self.emit_token(slot, token, logprob);
        }
    }

    /// Takes `token` as the next token of the sequence in `slot`: metrics, constraint, history, output and events;
    /// the sequence finishes or goes on to the next step with it.
    fn emit_token(&mut self, slot: Slot, token: u32, logprob: Option<TokenLogprob>) {
        let Some(seq) = self.slots[slot].as_mut() else {
            // Its job failed after the token was chosen.
            return;
        };
        let job = seq.job;
        let now = Instant::now();
        let Some(active) = self.jobs.get_mut(&job) else {
            return;
        };
        match seq.last_token_at {
            None if active.first_token => {
                let ttft = now - active.job.arrived;
                tracing::debug!(
                    ttft_ms = ttft.as_secs_f64() * 1e3,
                    prompt_tokens = seq.spec.prompt.len(),
                    cached_tokens = seq.cached,
                    "first token"
                );
                self.shared.metrics.ttft.record(ttft.as_secs_f64());
                active.first_token = false;
            }
            None => {}
            Some(last) => self.shared.metrics.tpot.record((now - last).as_secs_f64()),
        }
        seq.last_token_at = Some(now);
        self.shared.metrics.generation_tokens.increment(1);
        if let Some(c) = seq.constraint.as_mut() {
            if let Err(e) = c.consume(token) {
                self.fail_job(job, ApiError::internal(e.to_string()));
                return;
            }
        }
        seq.history.push(token);
        seq.generated.push(token);
        let deltas = match seq.output.push_token(token) {
            Ok(deltas) => deltas,
            Err(e) => {
                self.fail_job(job, ApiError::internal(format!("detokenizing failed: {e}")));
                return;
            }
        };
        let request = &seq.spec.request;
        let is_eos = !request.ignore_eos && self.eos.contains(&token);
        let logprob = if is_eos { None } else { logprob };
        let index = seq.spec.index;
        let finished = seq.output.is_finished();
        seq.phase = Phase::Decode { token };
        if self.send(job, Event::Token { index, deltas, logprob }).is_err() {
            return;
        }
        if finished {
            self.finish_seq(slot);
        }
    }

    /// The sequence in `slot` is done: its last text goes out, its slot is freed, and its job ends with it when it
    /// was the job's last.
    fn finish_seq(&mut self, slot: Slot) {
        let Some(seq) = self.slots[slot].take() else {
            return;
        };
        if let Some(hashes) = &seq.prompt_hashes {
            // The slot holds the prompt and every generated token but the last.
            let held = self.backend.len(slot);
            let tokens: Vec<u32> = seq
                .spec
                .prompt
                .iter()
                .chain(&seq.generated)
                .copied()
                .take(held)
                .collect();
            if tokens.len() == held {
                let prompt_len = seq.spec.prompt.len();
                let hash = if held >= prompt_len {
                    hashes.extended(prompt_len, &tokens[prompt_len..])
                } else {
                    hashes.of(held)
                };
                self.save_snapshot(slot, &tokens, hash);
            }
        }
        self.backend.release(slot);
        let job = seq.job;
        let index = seq.spec.index;
        let cached_tokens = seq.cached;
        match seq.output.finish() {
            Ok(output) => {
                let event = Event::Finished {
                    index,
                    output,
                    cached_tokens,
                };
                if self.send(job, event).is_err() {
                    return;
                }
            }
            Err(e) => {
                self.fail_job(job, ApiError::internal(format!("detokenizing failed: {e}")));
                return;
            }
        }
        if let Some(active) = self.jobs.get_mut(&job) {
            active.unfinished -= 1;
        }
        self.finish_job_if_done(job);
    }

    /// Ends job `id` with `Done` when all its sequences have finished.
    fn finish_job_if_done(&mut self, id: u64) {
        if self.jobs.get(&id).is_none_or(|a| a.unfinished != 0) {
            return;
        }
        let active = self.jobs.remove(&id).expect("looked up above");
        if self.admitting == Some(id) {
            self.admitting = None;
        }
        self.set_running();
        self.shared
            .metrics
            .e2e
            .record(active.job.arrived.elapsed().as_secs_f64());
        let _ = active.job.events.send(Event::Done);
    }

    /// Takes job `id` out: its slots are freed and its waiting sequences dropped. Returns it.
    fn remove_job(&mut self, id: u64) -> Option<Active> {
        let active = self.jobs.remove(&id)?;
        self.preempted.retain(|q| q.job != id);
        for slot in 0..self.slots.len() {
            if self.slots[slot].as_ref().is_some_and(|q| q.job == id) {
                self.slots[slot] = None;
                self.backend.release(slot);
            }
        }
        if self.admitting == Some(id) {
            self.admitting = None;
        }
        // The gauge drops before the client hears the end, so that what it reads next is up to date.
        self.set_running();
        Some(active)
    }

    fn cancel_job(&mut self, id: u64) {
        if let Some(active) = self.remove_job(id) {
            let _ = active.job.events.send(self.cancel_event());
        }
    }

    fn fail_job(&mut self, id: u64, error: ApiError) {
        if let Some(active) = self.remove_job(id) {
            tracing::error!("generation failed: {error}");
            let _ = active.job.events.send(Event::Error(error));
        }
    }

    fn fail_all(&mut self, error: ApiError) {
        let ids: Vec<u64> = self.jobs.keys().copied().collect();
        for id in ids {
            self.fail_job(id, error.clone());
        }
        // A slot or preempted sequence whose job is unknown (should a panic have left one) is dropped too.
        self.preempted.clear();
        for slot in 0..self.slots.len() {
            if self.slots[slot].take().is_some() {
                self.backend.release(slot);
            }
        }
        self.set_running();
    }

    /// Cancels the jobs whose client hung up, or all when the server cancels everything.
    fn drop_cancelled(&mut self) {
        let cancelled: Vec<u64> = self
            .jobs
            .iter()
            .filter(|(_, a)| is_cancelled(&self.shared, &a.job))
            .map(|(&id, _)| id)
            .collect();
        for id in cancelled {
            self.cancel_job(id);
        }
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
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job() -> Job {
        Job {
            sequences: Vec::new(),
            events: tokio::sync::mpsc::unbounded_channel().0,
            cancel: Arc::new(AtomicBool::new(false)),
            arrived: Instant::now(),
        }
    }

    #[test]
    fn a_job_the_engine_takes_uses_up_a_free_slot_at_once() {
        // One place to wait, and an idle engine with one free slot.
        let queue = JobQueue::new(1, Arc::new(Metrics::new()));
        queue.set_room(1);
        assert!(queue.submit(job()).is_ok());
        // The engine takes that job into its slot; its iteration has not yet set the room again.
        assert!(matches!(queue.pop(false), Popped::Job(_)));
        assert!(queue.submit(job()).is_ok(), "the next job waits in the one place");
        assert!(
            matches!(queue.submit(job()), Err(SubmitError::QueueFull)),
            "a third job found room in a slot the first had taken"
        );
    }
}
