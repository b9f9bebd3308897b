//! The continuous-batching engine driven directly, over a fake batch backend whose logits are a function of each
//! slot's tokens: random arrivals, prompt lengths, `max_tokens`, `n`, prompt logprobs, seeds, cancellations, a
//! pool too small for everyone and fewer slots than sequences. Every request must be answered or refused, no slot
//! or reserved token may leak, and every output must equal the one the request gets alone. The fake also keeps
//! snapshots for the prefix cache, holding context from the pool as a GPU's pages do, so that prompts sharing
//! prefixes under memory pressure (evictions while sequences run) must still give the outputs they get alone.

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lily_chat::{Delta, FinishReason, ToolCallIds};
use lily_model::sampling::SamplingParams;
use lily_model::{BatchBackend, Config, ForwardError, PrefillPart, Slot, SnapshotId, StepRow};
use lily_server::engine::{
    Engine, EngineHandle, EngineOptions, EngineShared, Event, Job, JobQueue, OutputKind, RequestSpec, SequenceSpec,
    SubmitError, DEFAULT_GRANT_AHEAD,
};
use lily_server::logits::Penalties;
use lily_server::metrics::Metrics;

use common::{tokenizer, EOS};

/// Tokens the fake grants context in.
const UNIT: usize = 16;

/// What the fake backend holds, shared with the test to check for leaks afterwards.
#[derive(Default)]
struct FakeSlots {
    tokens: Vec<Vec<u32>>,
    reserved: Vec<usize>,
    /// Broken promises of the engine (reserve before use, distinct rows, forks into empty slots ...).
    violations: Vec<String>,
    /// The most rows a step had, and the most sequences a prefill call had.
    widest_step: usize,
    widest_prefill: usize,
    /// Prompt tokens prefilled in all.
    prefilled: usize,
    /// Cuts that prefill calls of several sequences took.
    joined_cuts: usize,
    /// Snapshots: the tokens of the sequence each saved.
    snapshots: BTreeMap<SnapshotId, Vec<u32>>,
    next_snapshot: SnapshotId,
    restores: usize,
    /// Restores refused by `FakeBatch::fail_restores`.
    failed_restores: usize,
}

impl FakeSlots {
    /// Pool tokens a snapshot of `len` tokens holds.
    fn snapshot_cost(len: usize) -> usize {
        len.div_ceil(UNIT) * UNIT
    }

    fn held(&self) -> usize {
        self.reserved.iter().sum::<usize>()
            + self
                .snapshots
                .values()
                .map(|t| FakeSlots::snapshot_cost(t.len()))
                .sum::<usize>()
    }
}

struct FakeBatch {
    config: Config,
    max_context: usize,
    pool: usize,
    max_step_rows: usize,
    max_prefill: usize,
    /// Snapshots held at once at most (0: none).
    max_snapshots: usize,
    /// Whether it says it snapshots inside a prefill pass (it does so in the trait's default three calls), so
    /// that the engine cuts its calls at snapshot points instead of stopping there.
    in_pass: bool,
    /// Whether it says its steps are only queued (as a GPU's are), so that the engine queues the next step before
    /// it handles the last one's tokens and snapshots or frees slots while a step is queued.
    queues: bool,
    /// Sequences a prefill call takes at most (1: the trait's default, `prefill` alone).
    parts: usize,
    /// While set, every restore fails as a device error would (not a broken promise of the engine's).
    fail_restores: Arc<AtomicBool>,
    slots: Arc<Mutex<FakeSlots>>,
    /// The slot contents' hashes behind each output row of the last call.
    rows: Vec<u64>,
    logits: Vec<f32>,
}

impl FakeBatch {
    fn new(max_seqs: usize, pool: usize, max_step_rows: usize, max_prefill: usize) -> FakeBatch {
        let slots = FakeSlots {
            tokens: vec![Vec::new(); max_seqs],
            reserved: vec![0; max_seqs],
            ..Default::default()
        };
        let config = Config::tiny_shape();
        let logits = vec![0.0; config.vocab_size];
        FakeBatch {
            config,
            max_context: 4096,
            pool,
            max_step_rows,
            max_prefill,
            max_snapshots: 0,
            in_pass: false,
            queues: false,
            parts: 1,
            fail_restores: Arc::new(AtomicBool::new(false)),
            slots: Arc::new(Mutex::new(slots)),
            rows: Vec::new(),
            logits,
        }
    }

    fn fail(&self, slots: &mut FakeSlots, what: String) -> ForwardError {
        slots.violations.push(what.clone());
        ForwardError::Device(what)
    }
}

/// A hash of a sequence's tokens (FNV-1a): the fake's logits depend on nothing else.
fn hash(tokens: &[u32]) -> u64 {
    tokens.iter().fold(0xcbf29ce484222325u64, |h, &t| {
        (h ^ t as u64).wrapping_mul(0x100000001b3)
    })
}

impl BatchBackend for FakeBatch {
    fn config(&self) -> &Config {
        &self.config
    }
    fn max_context(&self) -> usize {
        self.max_context
    }
    fn max_seqs(&self) -> usize {
        self.slots.lock().unwrap().tokens.len()
    }
    fn max_step_rows(&self) -> usize {
        self.max_step_rows
    }
    fn max_prefill_tokens(&self) -> usize {
        self.max_prefill
    }
    fn queues_steps(&self) -> bool {
        self.queues
    }
    fn free_tokens(&self) -> usize {
        self.pool - self.slots.lock().unwrap().held()
    }
    fn reserve(&mut self, slot: Slot, tokens: usize) -> Result<bool, ForwardError> {
        let free = self.free_tokens();
        let mut s = self.slots.lock().unwrap();
        let want = tokens.div_ceil(UNIT) * UNIT;
        if want <= s.reserved[slot] {
            return Ok(true);
        }
        if want - s.reserved[slot] > free {
            return Ok(false);
        }
        s.reserved[slot] = want;
        Ok(true)
    }
    fn release(&mut self, slot: Slot) {
        let mut s = self.slots.lock().unwrap();
        s.tokens[slot].clear();
        s.reserved[slot] = 0;
    }
    fn len(&self, slot: Slot) -> usize {
        self.slots.lock().unwrap().tokens[slot].len()
    }
    fn prefill(&mut self, slot: Slot, tokens: &[u32]) -> Result<(), ForwardError> {
        let mut s = self.slots.lock().unwrap();
        if tokens.is_empty() || tokens.len() > self.max_prefill {
            return Err(self.fail(&mut s, format!("prefill of {} tokens", tokens.len())));
        }
        if s.tokens[slot].len() + tokens.len() > s.reserved[slot] {
            return Err(self.fail(&mut s, format!("prefill past the reservation of slot {slot}")));
        }
        s.tokens[slot].extend_from_slice(tokens);
        s.prefilled += tokens.len();
        self.rows = vec![hash(&s.tokens[slot])];
        Ok(())
    }
    fn max_prefill_parts(&self) -> usize {
        self.parts
    }
    /// Each part's pieces between its cuts one after another, a snapshot at each cut (as `snapshot` takes one).
    fn prefill_parts(&mut self, parts: &[PrefillPart<'_>]) -> Result<Vec<Vec<Option<SnapshotId>>>, ForwardError> {
        let mut s = self.slots.lock().unwrap();
        let total: usize = parts.iter().map(|p| p.tokens.len()).sum();
        let mut seen: Vec<Slot> = parts.iter().map(|p| p.slot).collect();
        seen.sort_unstable();
        seen.dedup();
        if parts.is_empty() || parts.len() > self.parts || seen.len() != parts.len() || total > self.max_prefill {
            let what = format!("a prefill call of {} parts, {total} tokens", parts.len());
            return Err(self.fail(&mut s, what));
        }
        for p in parts {
            if p.tokens.is_empty() || s.tokens[p.slot].len() + p.tokens.len() > s.reserved[p.slot] {
                return Err(self.fail(
                    &mut s,
                    format!("a prefill part past the reservation of slot {}", p.slot),
                ));
            }
            let inside = p.cuts.iter().all(|&c| c >= 1 && c < p.tokens.len());
            if !inside || !p.cuts.windows(2).all(|w| w[0] < w[1]) || (!self.in_pass && !p.cuts.is_empty()) {
                return Err(self.fail(&mut s, format!("cuts {:?} in a part of {}", p.cuts, p.tokens.len())));
            }
        }
        s.widest_prefill = s.widest_prefill.max(parts.len());
        s.prefilled += total;
        if parts.len() > 1 {
            s.joined_cuts += parts.iter().map(|p| p.cuts.len()).sum::<usize>();
        }
        drop(s);
        self.rows.clear();
        let mut ids = Vec::with_capacity(parts.len());
        for p in parts {
            let mut part_ids = Vec::new();
            let mut done = 0;
            for &end in p.cuts.iter().chain([&p.tokens.len()]) {
                self.slots.lock().unwrap().tokens[p.slot].extend_from_slice(&p.tokens[done..end]);
                if end < p.tokens.len() {
                    part_ids.push(self.snapshot(p.slot)?);
                }
                done = end;
            }
            ids.push(part_ids);
            let h = hash(&self.slots.lock().unwrap().tokens[p.slot]);
            self.rows.push(h);
        }
        Ok(ids)
    }
    fn fork(&mut self, from: Slot, to: Slot) -> Result<(), ForwardError> {
        let mut s = self.slots.lock().unwrap();
        if !s.tokens[to].is_empty() || s.reserved[to] < s.tokens[from].len() || from == to {
            return Err(self.fail(&mut s, format!("fork {from} -> {to}")));
        }
        s.tokens[to] = s.tokens[from].clone();
        Ok(())
    }
    fn step(&mut self, rows: &[StepRow]) -> Result<(), ForwardError> {
        let mut s = self.slots.lock().unwrap();
        let mut seen: Vec<Slot> = rows.iter().map(|r| r.slot).collect();
        seen.sort_unstable();
        seen.dedup();
        if rows.is_empty() || rows.len() > self.max_step_rows || seen.len() != rows.len() {
            return Err(self.fail(&mut s, format!("a step of rows {rows:?}")));
        }
        s.widest_step = s.widest_step.max(rows.len());
        self.rows.clear();
        for row in rows {
            if s.tokens[row.slot].is_empty() || s.tokens[row.slot].len() + 1 > s.reserved[row.slot] {
                return Err(self.fail(&mut s, format!("a step on slot {} past its reservation", row.slot)));
            }
            s.tokens[row.slot].push(row.token);
            let h = hash(&s.tokens[row.slot]);
            self.rows.push(h);
        }
        Ok(())
    }
    /// The next token is `1000 + h % 300` (logit 10), the runner-up `1000 + (h >> 20) % 300` (logit 9), every
    /// 23rd sequence state prefers end-of-sequence; the other tokens are all but impossible (logit -30), so that
    /// sampling draws ordinary text.
    fn logits(&mut self, row: usize) -> Result<&[f32], ForwardError> {
        let h = self.rows[row];
        self.logits.fill(-30.0);
        let first = if h.is_multiple_of(23) {
            EOS
        } else {
            1000 + (h % 300) as u32
        };
        self.logits[1000 + ((h >> 20) % 300) as usize] = 9.0;
        self.logits[first as usize] = 10.0;
        Ok(&self.logits)
    }
    fn describe(&self) -> String {
        "fake batch".into()
    }
    fn snapshot(&mut self, slot: Slot) -> Result<Option<SnapshotId>, ForwardError> {
        let free = self.free_tokens();
        let mut s = self.slots.lock().unwrap();
        if s.tokens[slot].is_empty() {
            return Err(self.fail(&mut s, format!("snapshot of the empty slot {slot}")));
        }
        let cost = FakeSlots::snapshot_cost(s.tokens[slot].len());
        if s.snapshots.len() >= self.max_snapshots || cost > free {
            return Ok(None);
        }
        let id = s.next_snapshot;
        s.next_snapshot += 1;
        let tokens = s.tokens[slot].clone();
        s.snapshots.insert(id, tokens);
        Ok(Some(id))
    }
    fn restore(&mut self, id: SnapshotId, slot: Slot, tokens: usize) -> Result<bool, ForwardError> {
        {
            let mut s = self.slots.lock().unwrap();
            if self.fail_restores.load(Ordering::SeqCst) {
                s.failed_restores += 1;
                return Err(ForwardError::Device(format!("restore of snapshot {id} failed")));
            }
            if !s.tokens[slot].is_empty() || s.reserved[slot] != 0 || !s.snapshots.contains_key(&id) {
                return Err(self.fail(&mut s, format!("restore of snapshot {id} into slot {slot}")));
            }
        }
        if !self.reserve(slot, tokens)? {
            return Ok(false);
        }
        let mut s = self.slots.lock().unwrap();
        s.tokens[slot] = s.snapshots[&id].clone();
        s.restores += 1;
        Ok(true)
    }
    fn drop_snapshot(&mut self, id: SnapshotId) {
        let mut s = self.slots.lock().unwrap();
        if s.snapshots.remove(&id).is_none() {
            s.violations.push(format!("drop of the unknown snapshot {id}"));
        }
    }
    fn snapshots_in_prefill(&self) -> bool {
        self.in_pass
    }
    fn snapshot_room(&self) -> usize {
        self.max_snapshots
            .saturating_sub(self.slots.lock().unwrap().snapshots.len())
    }
    fn snapshot_tokens(&self) -> usize {
        let s = self.slots.lock().unwrap();
        s.snapshots.values().map(|t| FakeSlots::snapshot_cost(t.len())).sum()
    }
}

/// One request of the random workload.
#[derive(Clone, Debug)]
struct Request {
    prompt: Arc<Vec<u32>>,
    n: usize,
    max_tokens: usize,
    temperature: f32,
    seed: u64,
    logprobs: Option<usize>,
    /// Generate past end-of-sequence tokens, to `max_tokens`.
    ignore_eos: bool,
    prompt_logprobs: Option<usize>,
    /// Start after this long.
    arrival: Duration,
    /// The client hangs up after this many token events (and sets the job's cancel flag).
    cancel_after: Option<usize>,
    /// Stop strings (a sequence they end runs past its last token in a step queued ahead).
    stop: Vec<String>,
}

impl Request {
    /// A greedy request of one choice that arrives at once and is read to its end.
    fn greedy(prompt: Vec<u32>, max_tokens: usize, seed: u64) -> Request {
        Request {
            prompt: Arc::new(prompt),
            n: 1,
            max_tokens,
            temperature: 0.0,
            seed,
            logprobs: None,
            ignore_eos: false,
            prompt_logprobs: None,
            arrival: Duration::ZERO,
            cancel_after: None,
            stop: Vec::new(),
        }
    }
}

/// What a client saw of one choice.
#[derive(Clone, Debug, Default, PartialEq)]
struct Choice {
    text: String,
    finish: Option<FinishReason>,
    tokens: usize,
    logprobs: Vec<(u32, f32)>,
    prompt_logprobs: Vec<(u32, f32)>,
}

#[derive(Debug, PartialEq)]
enum Answer {
    Done(BTreeMap<usize, Choice>),
    Error(u16),
    Cancelled,
    QueueFull,
}

fn job(request: &Request) -> (Job, tokio::sync::mpsc::UnboundedReceiver<Event>, Arc<AtomicBool>) {
    let spec = Arc::new(RequestSpec {
        kind: OutputKind::Text,
        penalties: Penalties::none(),
        stop: request.stop.clone(),
        ignore_eos: request.ignore_eos,
        logprobs: request.logprobs,
        prompt_logprobs: request.prompt_logprobs,
        constraint: None,
    });
    let sequences = (0..request.n)
        .map(|index| SequenceSpec {
            index,
            prompt: request.prompt.clone(),
            prompt_text: Arc::from(""),
            sampling: SamplingParams {
                temperature: request.temperature,
                // A top-k keeps the host sampler from sorting the whole vocabulary for every token.
                top_k: 50,
                seed: request.seed + index as u64,
                ..SamplingParams::default()
            },
            max_tokens: request.max_tokens,
            request: spec.clone(),
        })
        .collect();
    let (events, receiver) = tokio::sync::mpsc::unbounded_channel();
    let cancel = Arc::new(AtomicBool::new(false));
    let job = Job {
        sequences,
        events,
        cancel: cancel.clone(),
        arrived: Instant::now(),
    };
    (job, receiver, cancel)
}

/// Sends `request` and reads its events to the end (or hangs up as the request says).
fn client(handle: &EngineHandle, request: &Request) -> Answer {
    client_cached(handle, request).0
}

/// As [`client`], also returning the prompt tokens the choices took from the prefix cache.
fn client_cached(handle: &EngineHandle, request: &Request) -> (Answer, usize) {
    let mut cached = 0;
    let answer = read_answer(handle, request, &mut cached);
    (answer, cached)
}

fn read_answer(handle: &EngineHandle, request: &Request, cached: &mut usize) -> Answer {
    match submit(handle, request) {
        Ok((receiver, cancel)) => read_events(receiver, &cancel, request, cached),
        Err(answer) => answer,
    }
}

type Pending = (tokio::sync::mpsc::UnboundedReceiver<Event>, Arc<AtomicBool>);

/// Queues `request`: its events' receiver and cancel flag, or the answer to a refusal.
fn submit(handle: &EngineHandle, request: &Request) -> Result<Pending, Answer> {
    let (job, receiver, cancel) = job(request);
    match handle.submit(job) {
        Ok(_) => Ok((receiver, cancel)),
        Err(SubmitError::QueueFull) => Err(Answer::QueueFull),
        Err(SubmitError::EngineGone) => panic!("the engine is gone"),
    }
}

/// Reads a submitted request's events to the end (or hangs up as the request says).
fn read_events(
    mut receiver: tokio::sync::mpsc::UnboundedReceiver<Event>,
    cancel: &AtomicBool,
    request: &Request,
    cached: &mut usize,
) -> Answer {
    let mut choices: BTreeMap<usize, Choice> = BTreeMap::new();
    let mut token_events = 0;
    loop {
        if request.cancel_after.is_some_and(|k| token_events >= k) {
            cancel.store(true, Ordering::SeqCst);
            // Sometimes the client reads the engine's answer to the cancel, sometimes it is simply gone.
            if request.seed.is_multiple_of(2) {
                return Answer::Cancelled;
            }
        }
        let Some(event) = receiver.blocking_recv() else {
            panic!("the engine dropped a job without a last event");
        };
        match event {
            Event::Token { index, deltas, logprob } => {
                token_events += 1;
                let choice = choices.entry(index).or_default();
                for delta in deltas {
                    if let Delta::Content(text) = delta {
                        choice.text.push_str(&text);
                    }
                }
                if let Some(lp) = logprob {
                    choice.logprobs.push((lp.token, lp.logprob));
                }
            }
            Event::PromptLogprobs { index, logprobs, .. } => {
                let choice = choices.entry(index).or_default();
                choice.prompt_logprobs = logprobs.iter().map(|lp| (lp.token, lp.logprob)).collect();
            }
            Event::Finished {
                index,
                output,
                cached_tokens,
            } => {
                *cached += cached_tokens;
                let choice = choices.entry(index).or_default();
                for delta in output.deltas {
                    if let Delta::Content(text) = delta {
                        choice.text.push_str(&text);
                    }
                }
                choice.finish = Some(output.finish_reason);
                choice.tokens = output.completion_tokens;
            }
            Event::Error(error) => {
                return match error.code {
                    Some("cancelled") => Answer::Cancelled,
                    _ => Answer::Error(error.status.as_u16()),
                }
            }
            Event::Done => return Answer::Done(choices),
        }
    }
}

struct Running {
    handle: EngineHandle,
    thread: std::thread::JoinHandle<()>,
    slots: Arc<Mutex<FakeSlots>>,
    pool: usize,
    metrics: Arc<Metrics>,
}

/// An engine without the prefix cache taking `max_prefill_tokens` an iteration.
fn start(backend: FakeBatch, max_queue: usize, max_prefill_tokens: usize) -> Running {
    start_granting(backend, max_queue, max_prefill_tokens, DEFAULT_GRANT_AHEAD)
}

/// [`start`], granting sequences `grant_ahead` tokens of context at a time.
fn start_granting(backend: FakeBatch, max_queue: usize, max_prefill_tokens: usize, grant_ahead: usize) -> Running {
    let options = EngineOptions {
        max_prefill_tokens: Some(max_prefill_tokens),
        prefix_cache: false,
        grant_ahead,
        ..EngineOptions::default()
    };
    start_with(backend, max_queue, options)
}

fn start_with(backend: FakeBatch, max_queue: usize, options: EngineOptions) -> Running {
    start_queued(backend, max_queue, options, &[]).0
}

/// [`start_with`], the engine starting once `requests` are all in its queue, so that its first iteration finds
/// them waiting together whatever the threads' timing.
fn start_queued(
    backend: FakeBatch,
    max_queue: usize,
    options: EngineOptions,
    requests: &[Request],
) -> (Running, Vec<Result<Pending, Answer>>) {
    let metrics = Arc::new(Metrics::new());
    let shared = Arc::new(EngineShared {
        metrics: metrics.clone(),
        cancel_all: AtomicBool::new(false),
        queue: JobQueue::new(max_queue, metrics.clone()),
        in_flight: AtomicUsize::new(0),
    });
    let slots = backend.slots.clone();
    let pool = backend.pool;
    let engine = Engine::new(
        Box::new(backend),
        tokenizer(),
        ToolCallIds::Sequential,
        shared.clone(),
        options,
    );
    let handle = EngineHandle::new(shared);
    let pending = requests.iter().map(|request| submit(&handle, request)).collect();
    let thread = std::thread::spawn(move || engine.run());
    let running = Running {
        handle,
        thread,
        slots,
        pool,
        metrics,
    };
    (running, pending)
}

impl Running {
    /// Sequences the engine preempted so far (`lily_preemptions_total`).
    fn preemptions(&self) -> usize {
        let text = self.metrics.render();
        let line = text.lines().find(|l| l.starts_with("lily_preemptions_total"));
        line.and_then(|l| l.split_whitespace().last()?.parse().ok())
            .unwrap_or(0)
    }

    /// Closes the queue, waits for the engine to stop, and checks that nothing leaked.
    fn stop(self) {
        drop(self.handle);
        self.thread.join().expect("the engine thread ends");
        let s = self.slots.lock().unwrap();
        assert_eq!(
            s.violations,
            Vec::<String>::new(),
            "the engine broke the backend's contract"
        );
        assert!(
            s.reserved.iter().all(|&r| r == 0),
            "reserved tokens leaked: {:?}",
            s.reserved
        );
        assert!(s.tokens.iter().all(|t| t.is_empty()), "a slot was never released");
        assert!(s.held() <= self.pool, "snapshots hold more than the pool");
    }
}

/// A small deterministic generator (xorshift), so that a failing seed can be replayed.
struct Rand(u64);

impl Rand {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn workload(seed: u64, count: usize) -> Vec<Request> {
    let mut r = Rand(seed | 1);
    (0..count)
        .map(|i| {
            let len = match r.below(4) {
                0 => 1 + r.below(4) as usize,
                1 | 2 => 1 + r.below(60) as usize,
                _ => 100 + r.below(400) as usize,
            };
            let prompt: Vec<u32> = (0..len).map(|_| 1000 + r.below(300) as u32).collect();
            let max_tokens = match r.below(10) {
                // Prompt plus max_tokens past the pool: refused at once.
                0 => 1200,
                _ => 1 + r.below(40) as usize,
            };
            Request {
                prompt: Arc::new(prompt),
                n: if r.below(4) == 0 { 2 + r.below(3) as usize } else { 1 },
                max_tokens,
                temperature: if r.below(2) == 0 { 0.0 } else { 1.0 },
                seed: r.next() % 1000,
                logprobs: (r.below(5) == 0).then_some(2),
                ignore_eos: false,
                prompt_logprobs: (r.below(8) == 0).then_some(1),
                arrival: Duration::from_millis(r.below(200) + i as u64 * 3),
                cancel_after: (r.below(6) == 0).then(|| r.below(8) as usize),
                stop: match r.below(4) {
                    0 => vec!["e".into()],
                    _ => Vec::new(),
                },
            }
        })
        .collect()
}

#[test]
fn random_arrivals_are_all_answered_without_leaks_and_as_alone() {
    let mut stopped = 0;
    // With a grant of a few tokens, more slots and a smaller pool, sequences grow through the pool as they decode
    // and preempt each other where the arrivals' timing fills the pool (the deterministic test
    // sequences_outgrowing_the_pool_give_way_and_answer_as_alone checks that they do).
    for (seed, queues, parts, grant, slots, pool) in [
        (1, false, 1, DEFAULT_GRANT_AHEAD, 4, 1024),
        (2, false, 3, DEFAULT_GRANT_AHEAD, 4, 1024),
        (3, false, 1, 4, 8, 640),
        (1, true, 3, 4, 8, 640),
        (4, true, 1, DEFAULT_GRANT_AHEAD, 4, 1024),
        (5, true, 2, 1, 8, 576),
    ] {
        let requests = workload(seed, 40);
        // `slots` slots, a pool of `pool` tokens (a long prompt with its max_tokens takes up to 540), steps of at most
        // three rows, prompts in chunks of at most 50 tokens of which the engine takes 32 an iteration, in calls of
        // up to `parts` sequences; with `queues`, the engine queues steps ahead.
        let mut backend = FakeBatch::new(slots, pool, 3, 50);
        backend.queues = queues;
        backend.parts = parts;
        let running = start_granting(backend, 32, 32, grant);
        let answers: Vec<Answer> = std::thread::scope(|scope| {
            let handles: Vec<_> = requests
                .iter()
                .map(|request| {
                    let handle = &running.handle;
                    scope.spawn(move || {
                        std::thread::sleep(request.arrival);
                        client(handle, request)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        // How wide the steps and prefill calls got depends on the arrivals' timing: the deterministic test below
        // (prompts_waiting_together_share_a_prefill_call_and_its_steps) checks that they batch.
        running.stop();

        let mut done = 0;
        for (request, answer) in requests.iter().zip(&answers) {
            match answer {
                Answer::Done(choices) => {
                    done += 1;
                    assert!(request.prompt.len() + request.max_tokens <= pool);
                    assert_eq!(choices.len(), request.n, "seed {seed}: every choice finished");
                    stopped += choices
                        .values()
                        .filter(|c| !request.stop.is_empty() && c.finish == Some(FinishReason::Stop))
                        .count();
                    // The same request alone, on an engine of one slot, read to its end.
                    let alone = start(FakeBatch::new(1, 1024, 1, 1024), 4, 4096);
                    let whole = Request {
                        cancel_after: None,
                        ..request.clone()
                    };
                    let expected = client(&alone.handle, &whole);
                    alone.stop();
                    assert_eq!(answer, &expected, "seed {seed}: {request:?}");
                }
                Answer::Error(status) => {
                    assert_eq!(*status, 400, "seed {seed}: {request:?}");
                    assert!(request.prompt.len() + request.max_tokens > pool, "{request:?}");
                }
                Answer::Cancelled => assert!(request.cancel_after.is_some(), "seed {seed}: {request:?}"),
                Answer::QueueFull => {}
            }
        }
        assert!(done >= requests.len() / 2, "seed {seed}: only {done} requests ran");
    }
    assert!(stopped > 0, "no sequence ended at a stop string");
}

#[test]
fn a_greedy_sequence_is_the_same_whatever_runs_beside_it() {
    // With `queues`, the engine queues steps ahead while the requests that wait for a slot could not take one.
    for queues in [false, true] {
        a_sequence_is_the_same_beside_others(queues);
    }
}

fn a_sequence_is_the_same_beside_others(queues: bool) {
    // Slot shortage: eight requests for two slots, one of them with n = 3 (more choices than slots).
    let mut backend = FakeBatch::new(2, 4096, 2, 4096);
    backend.queues = queues;
    let running = start(backend, 16, 7);
    let requests: Vec<Request> = (0..8)
        .map(|i| Request {
            prompt: Arc::new((0..(1 + i * 13)).map(|t| 1000 + (t * 7 + i) as u32 % 300).collect()),
            n: if i == 3 { 3 } else { 1 },
            max_tokens: 30,
            temperature: if i % 2 == 0 { 0.0 } else { 0.8 },
            seed: i as u64,
            logprobs: None,
            ignore_eos: false,
            prompt_logprobs: (i == 5).then_some(0),
            arrival: Duration::ZERO,
            cancel_after: None,
            stop: Vec::new(),
        })
        .collect();
    let answers: Vec<Answer> = std::thread::scope(|scope| {
        let handles: Vec<_> = requests
            .iter()
            .map(|request| {
                let handle = &running.handle;
                scope.spawn(move || client(handle, request))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    running.stop();
    for (request, answer) in requests.iter().zip(&answers) {
        let alone = start(FakeBatch::new(1, 4096, 1, 4096), 4, 4096);
        let expected = client(&alone.handle, request);
        alone.stop();
        assert!(matches!(answer, Answer::Done(_)), "{answer:?}");
        assert_eq!(answer, &expected, "queues {queues}: {request:?}");
    }
}

/// Requests sharing prefixes (a few "system prompts", some requests repeating an earlier conversation and
/// extending it) on an engine with the prefix cache, a pool and a snapshot store both too small for everything:
/// snapshots are evicted while sequences that were restored from them still run. Every answer must equal the
/// request's answer alone on an engine without the cache, nothing may leak, and the cache must have been used.
/// Some runs take a backend that snapshots inside its prefill calls.
#[test]
fn shared_prefixes_reuse_snapshots_and_answer_as_alone_under_eviction() {
    let mut restores_total = 0;
    for (seed, in_pass, queues, parts) in [
        (5, false, false, 1),
        (6, false, false, 1),
        (7, false, false, 1),
        (7, true, false, 1),
        (8, true, false, 1),
        (5, false, true, 1),
        (8, true, true, 1),
        (6, false, false, 4),
        (8, true, true, 4),
        (9, true, false, 4),
        (10, true, true, 4),
    ] {
        let mut r = Rand(seed);
        let systems: Vec<Vec<u32>> = (0..3)
            .map(|_| (0..20 + r.below(120)).map(|_| 1000 + r.below(300) as u32).collect())
            .collect();
        let mut requests: Vec<Request> = Vec::new();
        for i in 0..36 {
            let mut prompt = systems[r.below(3) as usize].clone();
            // A third extend an earlier request's prompt (the next turn of its conversation).
            if i > 3 && r.below(3) == 0 {
                prompt = (*requests[r.below(i as u64) as usize].prompt).clone();
            }
            prompt.extend((0..1 + r.below(40)).map(|_| 1000 + r.below(300) as u32));
            requests.push(Request {
                prompt: Arc::new(prompt),
                n: if r.below(6) == 0 { 2 } else { 1 },
                max_tokens: 1 + r.below(30) as usize,
                temperature: if r.below(2) == 0 { 0.0 } else { 1.0 },
                seed: r.next() % 1000,
                logprobs: (r.below(5) == 0).then_some(2),
                ignore_eos: false,
                prompt_logprobs: (r.below(10) == 0).then_some(1),
                arrival: Duration::from_millis(r.below(150) + i as u64 * 4),
                cancel_after: (r.below(8) == 0).then(|| r.below(6) as usize),
                stop: match r.below(5) {
                    0 => vec!["e".into()],
                    _ => Vec::new(),
                },
            });
        }
        let mut backend = FakeBatch::new(4, 1024, 3, 50);
        backend.max_snapshots = 12;
        backend.in_pass = in_pass;
        backend.queues = queues;
        backend.parts = parts;
        let options = EngineOptions {
            max_prefill_tokens: Some(32),
            prefix_cache: true,
            snapshot_interval: 48,
            // Half the runs grant context a few tokens at a time, so that preempted sequences resume from the
            // prefix cache.
            grant_ahead: if seed % 2 == 0 { 2 } else { DEFAULT_GRANT_AHEAD },
        };
        let running = start_with(backend, 64, options);
        let answers: Vec<(Answer, usize)> = std::thread::scope(|scope| {
            let handles: Vec<_> = requests
                .iter()
                .map(|request| {
                    let handle = &running.handle;
                    scope.spawn(move || {
                        std::thread::sleep(request.arrival);
                        client_cached(handle, request)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let restores = running.slots.lock().unwrap().restores;
        running.stop();
        let mut cached_total = 0;
        for (request, (answer, cached)) in requests.iter().zip(&answers) {
            match answer {
                Answer::Done(_) => {
                    assert!(*cached < request.prompt.len() * request.n, "{request:?}");
                    if request.prompt_logprobs.is_some() {
                        assert_eq!(*cached, 0, "prompt logprobs need the whole prompt: {request:?}");
                    }
                    cached_total += cached;
                    let alone = start(FakeBatch::new(1, 1024, 1, 1024), 4, 4096);
                    let whole = Request {
                        cancel_after: None,
                        ..request.clone()
                    };
                    let expected = client(&alone.handle, &whole);
                    alone.stop();
                    assert_eq!(answer, &expected, "seed {seed}: {request:?}");
                }
                Answer::Cancelled => assert!(request.cancel_after.is_some(), "seed {seed}: {request:?}"),
                other => panic!("seed {seed}: {other:?} for {request:?}"),
            }
        }
        // How many requests find a snapshot depends on their timing; every run must find some.
        assert!(restores > 0, "seed {seed}: no restores");
        assert!(cached_total > 0, "seed {seed}: no request reported cached tokens");
        restores_total += restores;
    }
    assert!(restores_total > 20, "only {restores_total} restores in all");
}

/// Prompts waiting together share the prefill calls and the steps, whatever the threads' timing (the random tests'
/// arrivals decide how often that happens there): four prompts of 40 tokens, each starting a new message at token
/// 20, queued before the engine starts, on a backend taking four sequences a call and snapshotting inside its pass.
/// One call prefills all four, cut at each one's message start; the steps run all four rows; every answer is the
/// request's alone.
#[test]
fn prompts_waiting_together_share_a_prefill_call_and_its_steps() {
    let mut backend = FakeBatch::new(4, 4096, 4, 256);
    backend.parts = 4;
    backend.in_pass = true;
    backend.max_snapshots = 16;
    let options = EngineOptions {
        max_prefill_tokens: Some(256),
        prefix_cache: true,
        snapshot_interval: 0,
        ..EngineOptions::default()
    };
    let im_start = tokenizer().token_to_id("<|im_start|>").expect("the chat tokenizer");
    let requests: Vec<Request> = (0..4)
        .map(|i| {
            // Different first tokens: no prompt could start from another's snapshot.
            let mut prompt: Vec<u32> = (0..20).map(|t| 1000 + ((t * 7 + 50 * i) % 300) as u32).collect();
            prompt.push(im_start);
            prompt.extend((0..19).map(|t| 1000 + ((t * 11 + 30 * i) % 300) as u32));
            Request::greedy(prompt, 8, i as u64)
        })
        .collect();
    let (running, pending) = start_queued(backend, 16, options, &requests);
    let answers: Vec<Answer> = (pending.into_iter().zip(&requests))
        .map(|(pending, request)| {
            let (receiver, cancel) = pending.expect("queued");
            read_events(receiver, &cancel, request, &mut 0)
        })
        .collect();
    let (widest_prefill, joined_cuts, widest_step) = {
        let s = running.slots.lock().unwrap();
        (s.widest_prefill, s.joined_cuts, s.widest_step)
    };
    running.stop();
    assert_eq!(widest_prefill, 4, "one prefill call for the four prompts");
    assert_eq!(joined_cuts, 4, "each part snapshotted at its message start");
    assert_eq!(widest_step, 4, "steps of the four sequences");
    for (request, answer) in requests.iter().zip(&answers) {
        let alone = start(FakeBatch::new(1, 4096, 1, 1024), 4, 4096);
        let expected = client(&alone.handle, request);
        alone.stop();
        assert!(matches!(answer, Answer::Done(_)), "{answer:?}");
        assert_eq!(answer, &expected);
    }
}

/// A restore that fails while a prefill call is being planned fails its job alone. Job A has two prompts: a long
/// one (Z) and one (Y) that shares its first 64 tokens with job C's prompt (X). C prefills X first (Y waits, as it
/// shares X's snapshot points) and snapshots it; then a call starts with Z's chunk, and Y, joining it, catches up
/// from X's snapshot, whose restore fails. Job A fails there and its sequences leave their slots, so Z's chunk
/// leaves the call too (once, the call went on with Z's emptied slot and the engine panicked, failing every request).
/// C is answered as alone, and the engine goes on serving.
#[test]
fn a_failed_restore_while_a_prefill_call_is_planned_fails_only_its_job() {
    let mut backend = FakeBatch::new(4, 4096, 4, 64);
    backend.parts = 4;
    backend.max_snapshots = 16;
    let fail_restores = backend.fail_restores.clone();
    fail_restores.store(true, Ordering::SeqCst);
    let options = EngineOptions {
        max_prefill_tokens: Some(32),
        prefix_cache: true,
        snapshot_interval: 16,
        ..EngineOptions::default()
    };
    let shared: Vec<u32> = (0..64).map(|t| 1000 + (t * 7 % 300) as u32).collect();
    let with_tail = |start: u32| -> Vec<u32> { (shared.iter().copied()).chain((0..8).map(|t| start + t)).collect() };
    let x = with_tail(1100);
    let y = with_tail(1200);
    let z: Vec<u32> = (0..200).map(|t| 1000 + ((t * 13 + 5) % 300) as u32).collect();
    let c = Request::greedy(x, 4, 1);
    let (running, mut pending) = start_queued(backend, 8, options, std::slice::from_ref(&c));
    // Job A, two sequences with different prompts (as a completion request with a list of prompts sends).
    let (mut a, receiver, cancel) = job(&Request::greedy(z.clone(), 4, 2));
    let mut second = a.sequences[0].clone();
    (second.index, second.prompt) = (1, Arc::new(y));
    a.sequences.push(second);
    running.handle.submit(a).ok().expect("queued");
    let two = Request {
        n: 2,
        ..Request::greedy(z, 4, 2)
    };
    let a_answer = read_events(receiver, &cancel, &two, &mut 0);
    let (receiver, cancel) = pending.remove(0).expect("queued");
    let c_answer = read_events(receiver, &cancel, &c, &mut 0);
    fail_restores.store(false, Ordering::SeqCst);
    let after = Request::greedy((0..40).map(|t| 1000 + (t * 3 % 300) as u32).collect(), 4, 3);
    let after_answer = client(&running.handle, &after);
    let failed_restores = running.slots.lock().unwrap().failed_restores;
    running.stop();
    assert!(failed_restores >= 1, "the scenario reached no restore");
    assert_eq!(a_answer, Answer::Error(500));
    for (request, answer) in [(&c, c_answer), (&after, after_answer)] {
        let alone = start(FakeBatch::new(1, 4096, 1, 1024), 4, 4096);
        let expected = client(&alone.handle, request);
        alone.stop();
        assert!(matches!(answer, Answer::Done(_)), "{answer:?}");
        assert_eq!(answer, expected);
    }
}

/// One long shared prompt sent by many clients at once is prefilled once: the first admitted prefills it, the
/// others restore it before their first chunk.
#[test]
fn concurrent_requests_with_one_prompt_prefill_it_once() {
    for (parts, chunk) in [(1, 64), (8, 1024)] {
        one_prompt_prefilled_once(parts, chunk);
    }
}

/// A backend taking `parts` sequences a prefill call of `chunk` tokens (room for the whole shared prompt and more)
/// must not have the waiting ones prefill the shared part beside the first.
fn one_prompt_prefilled_once(parts: usize, chunk: usize) {
    let mut backend = FakeBatch::new(8, 8192, 8, chunk);
    backend.max_snapshots = 32;
    backend.parts = parts;
    let prefills = backend.slots.clone();
    let options = EngineOptions {
        max_prefill_tokens: Some(chunk),
        prefix_cache: true,
        snapshot_interval: 0,
        ..EngineOptions::default()
    };
    let running = start_with(backend, 64, options);
    let system: Vec<u32> = (0..600).map(|t| 1000 + (t * 31 % 300) as u32).collect();
    let im_start = tokenizer().token_to_id("<|im_start|>").expect("the chat tokenizer");
    let requests: Vec<Request> = (0..8)
        .map(|i| {
            // A new message starts after the shared part: the engine snapshots there.
            let mut prompt = system.clone();
            prompt.push(im_start);
            prompt.extend((0..10).map(|t| 1000 + ((t + i) * 17 % 300) as u32));
            Request::greedy(prompt, 5, i as u64)
        })
        .collect();
    let answers: Vec<(Answer, usize)> = std::thread::scope(|scope| {
        let handles: Vec<_> = requests
            .iter()
            .map(|request| {
                let handle = &running.handle;
                scope.spawn(move || client_cached(handle, request))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let (restores, prefilled) = {
        let s = prefills.lock().unwrap();
        (s.restores, s.prefilled)
    };
    running.stop();
    // The shared part once, each request's own ten tokens and the message start once each.
    assert_eq!(
        prefilled,
        system.len() + requests.len() * 11,
        "parts {parts}: prompt tokens prefilled"
    );
    let cached: Vec<usize> = answers.iter().map(|(_, c)| *c).collect();
    // All but the first take the shared part from the cache.
    let hits = cached.iter().filter(|&&c| c >= 600).count();
    assert!(hits >= 7, "parts {parts}: cached tokens per request: {cached:?}");
    assert!(restores >= 7);
    for (answer, _) in &answers {
        assert!(matches!(answer, Answer::Done(_)), "{answer:?}");
    }
}

/// The whole prompt is snapshotted, after its first token is out: the next request that extends it by one token
/// restores all of it (its lookup cannot reach the snapshot at the reply's end), and answers as without the cache.
/// A sequence that finishes with its first token is snapshotted as it finishes instead.
#[test]
fn a_prompt_is_snapshotted_whole_and_extended_from_there() {
    for (max_tokens, in_pass) in [(1, false), (4, false), (4, true)] {
        let mut backend = FakeBatch::new(2, 4096, 2, 64);
        backend.max_snapshots = 8;
        backend.in_pass = in_pass;
        let options = EngineOptions {
            max_prefill_tokens: Some(64),
            prefix_cache: true,
            snapshot_interval: 0,
            ..EngineOptions::default()
        };
        let running = start_with(backend, 8, options);
        let prompt: Vec<u32> = (0..150).map(|t| 1000 + (t * 37 % 300) as u32).collect();
        let (first, cached) = client_cached(&running.handle, &Request::greedy(prompt.clone(), max_tokens, 1));
        assert!(matches!(first, Answer::Done(_)), "{first:?}");
        assert_eq!(cached, 0);
        let mut longer = prompt.clone();
        longer.push(1234);
        let next = Request::greedy(longer, max_tokens, 1);
        let (answer, cached) = client_cached(&running.handle, &next);
        running.stop();
        assert_eq!(cached, prompt.len(), "max_tokens {max_tokens}, in pass {in_pass}");
        let alone = start(FakeBatch::new(1, 4096, 1, 1024), 4, 4096);
        let expected = client(&alone.handle, &next);
        alone.stop();
        assert_eq!(answer, expected);
    }
}

/// A pool that holds two whole sequences runs four at once, each granted context as it decodes: when it runs out,
/// the sequences admitted last give their context back and are computed again later (from the prefix cache where
/// it is on), and every answer (greedy, sampled, with logprobs, prompt logprobs and two choices) is still the
/// request's alone. With whole reservations (prompt plus `max_tokens` at admission) two would run at a time.
#[test]
fn sequences_outgrowing_the_pool_give_way_and_answer_as_alone() {
    for (queues, prefix_cache) in [(false, false), (true, false), (false, true), (true, true)] {
        // The last client hangs up after 60 tokens, and waits for the engine's answer (its seed is odd).
        let requests: Vec<Request> = (0..7)
            .map(|i| Request {
                n: if i == 4 { 2 } else { 1 },
                cancel_after: (i == 6).then_some(60),
                temperature: if i % 2 == 0 { 0.0 } else { 0.8 },
                logprobs: (i == 1).then_some(2),
                prompt_logprobs: (i == 2).then_some(1),
                ignore_eos: true,
                ..Request::greedy(
                    (0..30 + i * 5).map(|t| 1000 + (t * 11 + i * 3) as u32 % 300).collect(),
                    200,
                    i as u64,
                )
            })
            .collect();
        // Eight slots, a pool of 512 tokens (a sequence reaches 260 at most), steps of up to eight rows.
        let mut backend = FakeBatch::new(8, 512, 8, 512);
        backend.queues = queues;
        backend.max_snapshots = if prefix_cache { 8 } else { 0 };
        let options = EngineOptions {
            max_prefill_tokens: Some(512),
            prefix_cache,
            grant_ahead: 16,
            ..EngineOptions::default()
        };
        let (running, pending) = start_queued(backend, 16, options, &requests);
        let answers: Vec<Answer> = std::thread::scope(|scope| {
            let handles: Vec<_> = (pending.into_iter().zip(&requests))
                .map(|(pending, request)| {
                    scope.spawn(move || {
                        let (receiver, cancel) = pending.expect("queued");
                        read_events(receiver, &cancel, request, &mut 0)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let preemptions = running.preemptions();
        let widest = running.slots.lock().unwrap().widest_step;
        running.stop();
        assert!(
            preemptions > 0,
            "queues {queues}, cache {prefix_cache}: nothing was preempted"
        );
        assert!(
            widest >= 4,
            "queues {queues}, cache {prefix_cache}: at most {widest} sequences stepped together"
        );
        for (request, answer) in requests.iter().zip(&answers) {
            if request.cancel_after.is_some() {
                assert_eq!(answer, &Answer::Cancelled);
                continue;
            }
            let alone = start(FakeBatch::new(1, 4096, 1, 4096), 4, 4096);
            let expected = client(&alone.handle, request);
            alone.stop();
            let Answer::Done(choices) = answer else {
                panic!("queues {queues}, cache {prefix_cache}: {answer:?} for {request:?}");
            };
            assert!(choices.values().all(|c| c.tokens == 200), "{choices:?}");
            assert_eq!(answer, &expected, "queues {queues}, cache {prefix_cache}: {request:?}");
        }
    }
}
