//! The engine's own cost per generated token, without a model: many sequences through the continuous-batching
//! engine over a backend whose steps cost nothing and whose picks are drawn "on the device" (no logits copied out),
//! as a GPU backend's greedy rows are. What this measures is what the host adds to every batched step.
//!
//!     cargo run --release -p lily-server --example engine_overhead -- [SEQUENCES] [TOKENS]

use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::Arc;
use std::time::Instant;

use lily_chat::{Tokenizer, ToolCallIds};
use lily_model::sampling::SamplingParams;
use lily_model::{BatchBackend, Config, ForwardError, Pick, Slot, StepRow};
use lily_server::engine::{
    Engine, EngineHandle, EngineOptions, EngineShared, Event, Job, JobQueue, OutputKind, RequestSpec, SequenceSpec,
};
use lily_server::logits::Penalties;
use lily_server::metrics::Metrics;

/// A backend of free steps: each slot's next token is a function of its length.
struct FreeSteps {
    config: Config,
    lens: Vec<usize>,
    rows: Vec<Slot>,
    steps: usize,
}

impl BatchBackend for FreeSteps {
    fn config(&self) -> &Config {
        &self.config
    }
    fn max_context(&self) -> usize {
        1 << 20
    }
    fn max_seqs(&self) -> usize {
        self.lens.len()
    }
    fn max_step_rows(&self) -> usize {
        self.lens.len()
    }
    fn max_prefill_tokens(&self) -> usize {
        4096
    }
    /// As a GPU backend does, so that the engine queues steps ahead as it does there.
    fn queues_steps(&self) -> bool {
        true
    }
    fn free_tokens(&self) -> usize {
        1 << 30
    }
    fn reserve(&mut self, _slot: Slot, _tokens: usize) -> Result<bool, ForwardError> {
        Ok(true)
    }
    fn release(&mut self, slot: Slot) {
        self.lens[slot] = 0;
    }
    fn len(&self, slot: Slot) -> usize {
        self.lens[slot]
    }
    fn prefill(&mut self, slot: Slot, tokens: &[u32]) -> Result<(), ForwardError> {
        self.lens[slot] += tokens.len();
        self.rows = vec![slot];
        Ok(())
    }
    fn fork(&mut self, from: Slot, to: Slot) -> Result<(), ForwardError> {
        self.lens[to] = self.lens[from];
        Ok(())
    }
    fn step(&mut self, rows: &[StepRow]) -> Result<(), ForwardError> {
        self.steps += 1;
        self.rows.clear();
        for r in rows {
            self.lens[r.slot] += 1;
            self.rows.push(r.slot);
        }
        Ok(())
    }
    fn logits(&mut self, _row: usize) -> Result<&[f32], ForwardError> {
        Err(ForwardError::Device("this backend draws every pick itself".into()))
    }
    fn sample(&mut self, picks: &mut [Pick<'_>]) -> Result<Vec<u32>, ForwardError> {
        Ok(picks
            .iter()
            .map(|p| 1000 + (self.lens[self.rows[p.row]] * 7919 % 30000) as u32)
            .collect())
    }
    fn describe(&self) -> String {
        "free steps".into()
    }
}

fn main() {
    let mut args = std::env::args().skip(1).map(|a| a.parse::<usize>().expect("a number"));
    let sequences = args.next().unwrap_or(256);
    let tokens = args.next().unwrap_or(500);
    let dir = lily_model::default_model::locate().expect("the bundled model's tokenizer");
    let tokenizer = Arc::new(Tokenizer::from_dir(&dir).expect("tokenizer"));
    let metrics = Arc::new(Metrics::new());
    let shared = Arc::new(EngineShared {
        metrics: metrics.clone(),
        cancel_all: AtomicBool::new(false),
        queue: JobQueue::new(sequences, metrics),
        in_flight: AtomicUsize::new(0),
    });
    let backend = FreeSteps {
        config: Config::tiny_shape(),
        lens: vec![0; sequences],
        rows: Vec::new(),
        steps: 0,
    };
    let engine = Engine::new(
        Box::new(backend),
        tokenizer,
        ToolCallIds::Sequential,
        shared.clone(),
        EngineOptions::default(),
    );
    let thread = std::thread::spawn(move || engine.run());
    let handle = EngineHandle::new(shared);
    let request = Arc::new(RequestSpec {
        kind: OutputKind::Text,
        penalties: Penalties::none(),
        stop: Vec::new(),
        ignore_eos: true,
        logprobs: None,
        prompt_logprobs: None,
        constraint: None,
    });
    let start = Instant::now();
    let receivers: Vec<_> = (0..sequences)
        .map(|i| {
            let (events, receiver) = tokio::sync::mpsc::unbounded_channel();
            let prompt: Vec<u32> = (0..100).map(|t| 1000 + ((t + i) * 31 % 30000) as u32).collect();
            let job = Job {
                sequences: vec![SequenceSpec {
                    index: 0,
                    prompt: Arc::new(prompt),
                    prompt_text: Arc::from(""),
                    sampling: SamplingParams::default(),
                    max_tokens: tokens,
                    request: request.clone(),
                }],
                events,
                cancel: Arc::new(AtomicBool::new(false)),
                arrived: Instant::now(),
            };
            handle.submit(job).ok().expect("room in the queue");
            receiver
        })
        .collect();
    // Each stream is read by its own task on a multi-threaded runtime, as the server's responses are, so every
    // event the engine sends may wake a parked task on another thread.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .expect("a runtime");
    let generated: usize = runtime.block_on(async {
        let tasks: Vec<_> = receivers
            .into_iter()
            .map(|mut receiver| {
                tokio::spawn(async move {
                    let mut tokens = 0usize;
                    while let Some(event) = receiver.recv().await {
                        match event {
                            Event::Token { .. } => tokens += 1,
                            Event::Done | Event::Error(_) => break,
                            _ => {}
                        }
                    }
                    tokens
                })
            })
            .collect();
        let mut total = 0;
        for task in tasks {
            total += task.await.expect("a reader task");
        }
        total
    });
    let seconds = start.elapsed().as_secs_f64();
    drop(handle);
    thread.join().expect("the engine stops");
    println!(
        "{sequences} sequences x {tokens} tokens: {generated} tokens in {seconds:.2} s: {:.0} tok/s, {:.2} us of host \
         time a token, {:.2} ms a step of {sequences} rows",
        generated as f64 / seconds,
        seconds * 1e6 / generated as f64,
        seconds * 1e3 / tokens as f64
    );
}
