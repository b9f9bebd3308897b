//! Server lifecycle: bind first, load the model in the background (`/health` 503 until ready), serve, and shut
//! down gracefully (stop accepting, let in-flight requests finish for a grace period, then cancel them).

use std::net::SocketAddr;
use std::panic::AssertUnwindSafe;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use lily_chat::{ChatTemplate, Tokenizer, ToolCallIds};
use lily_model::BatchBackend;
use lily_structured::StructuredEnv;
use tokio::sync::watch;

use crate::args::{ReasoningField, ServeArgs};
use crate::conversations::ConversationStore;
use crate::engine::{Engine, EngineHandle, EngineOptions, EngineShared, JobQueue};
use crate::limits::{RequestLimits, DEFAULT_REQUEST_CONTEXTS};
use crate::metrics::Metrics;
use crate::params::GenerationDefaults;
use crate::response_store::ResponseStore;

/// Builds the batch backend, on the engine thread, for a context of the given number of tokens per sequence and
/// the pool the server was asked for.
pub type BackendFactory = Box<dyn FnOnce(usize, &PoolOptions) -> Result<Box<dyn BatchBackend>> + Send + 'static>;

/// How many sequences the backend holds at once and how much context they share (`--max-seqs`, `--kv-tokens`).
#[derive(Debug, Clone, Default)]
pub struct PoolOptions {
    /// Slots (sequences resident at once); `None`: the backend's default.
    pub max_seqs: Option<usize>,
    /// Context tokens the slots share; `None`: the backend's default.
    pub kv_tokens: Option<usize>,
    /// Bytes the prefix cache's snapshots may take; `None`: the backend's default; 0 with the cache off.
    pub prefix_cache_bytes: Option<usize>,
}

/// The CPU backend's default memory for prefix-cache snapshots.
pub const DEFAULT_CPU_PREFIX_CACHE_BYTES: usize = 4 << 30;

/// The CPU backend's default number of slots.
pub const DEFAULT_CPU_MAX_SEQS: usize = 4;

/// The default context on CPU when `--context` is not given (capped by the model's `max_position_embeddings`).
pub const DEFAULT_CONTEXT: usize = 32768;

#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub host: String,
    /// 0 picks a free port (see [`RunningServer::local_addr`]).
    pub port: u16,
    pub model_dir: PathBuf,
    /// The id clients see in `/v1/models` and send as `model`.
    pub model_id: String,
    pub api_key: Option<String>,
    /// Requests that may wait behind the running ones; more are refused with 429.
    pub max_queue: usize,
    /// Tokens of context (prompt + completion); default: min(max_position_embeddings, 32768).
    pub context: Option<usize>,
    pub max_body_bytes: usize,
    pub reasoning_field: ReasoningField,
    /// How long in-flight requests may run on after a shutdown signal before they are cancelled.
    pub shutdown_timeout: Duration,
    /// `Sequential` gives `call_0`, `call_1`, ... (tests); `Random` OpenAI-like random ids.
    pub tool_call_ids: ToolCallIds,
    /// Tokenize special-token text inside message content as control tokens (the behaviour before content was
    /// kept plain); off by default.
    pub special_tokens_in_content: bool,
    /// A connection must send a request's headers within this time, and is closed after this long idle.
    pub header_timeout: Duration,
    /// A request's body must arrive within this time (408 otherwise).
    pub body_timeout: Duration,
    /// Connections open at once; more wait to be accepted.
    pub max_connections: usize,
    /// Origins whose browser pages may call the server (CORS); `*` for any. Empty: none.
    pub allowed_origins: Vec<String>,
    /// Most choices (prompts x `n`) per request.
    pub max_choices: usize,
    /// Most tokens (prompt plus `max_tokens` over all choices) per request; default: 16 contexts.
    pub max_request_tokens: Option<usize>,
    /// Slots and context pool of the backend.
    pub pool: PoolOptions,
    /// How the engine schedules (prompt tokens per iteration).
    pub engine: EngineOptions,
    /// Bytes of finished `/v1/responses` answers kept for `previous_response_id` and retrieval (0: none kept);
    /// conversations have the same amount again.
    pub response_store_bytes: usize,
    /// Build the token trie of constrained decoding while the weights load, so that the first request with a
    /// `response_format` or tools does not wait for it; otherwise that request builds it.
    pub structured_at_start: bool,
}

impl ServerConfig {
    pub fn new(model_dir: PathBuf, model_id: String) -> ServerConfig {
        ServerConfig {
            host: "127.0.0.1".into(),
            port: 8000,
            model_dir,
            model_id,
            api_key: None,
            max_queue: 64,
            context: None,
            max_body_bytes: 8 * 1024 * 1024,
            reasoning_field: ReasoningField::ReasoningContent,
            shutdown_timeout: Duration::from_secs(30),
            tool_call_ids: ToolCallIds::Random,
            special_tokens_in_content: false,
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(60),
            max_connections: 512,
            allowed_origins: Vec::new(),
            max_choices: crate::limits::DEFAULT_MAX_CHOICES,
            max_request_tokens: None,
            pool: PoolOptions::default(),
            engine: EngineOptions::default(),
            response_store_bytes: DEFAULT_RESPONSE_STORE_MIB << 20,
            structured_at_start: true,
        }
    }
}

/// MiB of finished responses the server keeps by default (`--response-store-mib`).
pub const DEFAULT_RESPONSE_STORE_MIB: usize = 256;

/// What requests need once the model is loaded.
pub struct Ready {
    pub tokenizer: Arc<Tokenizer>,
    pub template: ChatTemplate,
    /// Tokens of context per sequence (the backend's).
    pub context: usize,
    /// Token ids clients may send (prompt ids, `logit_bias` keys, `/detokenize`) are below this: the ids the
    /// tokenizer knows. The model's logits are wider (padded to a multiple of 64), and the padding ids have no text.
    pub vocab_size: usize,
    pub defaults: GenerationDefaults,
    pub backend_name: String,
    /// Sequences the backend runs at once.
    pub max_seqs: usize,
    /// Context tokens the sequences share (the pool, with every slot empty).
    pub kv_tokens: usize,
    /// Prompt tokens one engine iteration prefills at most.
    pub max_prefill_tokens: usize,
    /// Whether prompts reuse cached prefixes.
    pub prefix_cache: bool,
    pub limits: RequestLimits,
    /// See [`ServerConfig::special_tokens_in_content`].
    pub special_tokens_in_content: bool,
    /// The token trie for constrained decoding: built while the weights load (`structured_at_start`), or by the
    /// first constrained request.
    pub structured: Arc<LazyStructured>,
}

/// The token trie for constrained decoding. It takes about a second of one core to build, so it is built once: on a
/// thread of its own while the weights load ([`LazyStructured::build_in_background`]), or when the first request
/// that needs it is prepared (on the blocking pool). A request that needs it while the thread still builds it
/// waits for that build rather than starting another.
pub struct LazyStructured {
    tokenizer: Arc<Tokenizer>,
    vocab_size: usize,
    env: OnceLock<Option<StructuredEnv>>,
}

impl LazyStructured {
    /// The trie for `tokenizer` over a model of `vocab_size` logits, built on first use.
    pub fn new(tokenizer: Arc<Tokenizer>, vocab_size: usize) -> Self {
        LazyStructured {
            tokenizer,
            vocab_size,
            env: OnceLock::new(),
        }
    }

    /// The trie, or `None` when the tokenizer does not fit the model's vocabulary (constrained requests are then
    /// refused).
    pub fn get(&self) -> Option<&StructuredEnv> {
        self.env
            .get_or_init(|| match StructuredEnv::new(self.tokenizer.clone(), self.vocab_size) {
                Ok(env) => Some(env),
                Err(e) => {
                    tracing::warn!("structured outputs are unavailable: {e}");
                    None
                }
            })
            .as_ref()
    }

    /// Builds the trie on a thread of its own (a no-op once built).
    pub fn build_in_background(self: &Arc<Self>) -> std::io::Result<std::thread::JoinHandle<()>> {
        let lazy = self.clone();
        std::thread::Builder::new()
            .name("lily-structured".into())
            .spawn(move || {
                let start = Instant::now();
                if lazy.get().is_some() {
                    tracing::debug!(ms = start.elapsed().as_secs_f64() * 1e3, "built the token trie");
                }
            })
    }
}

pub struct AppState {
    pub config: ServerConfig,
    pub ready: OnceLock<Ready>,
    pub engine: EngineHandle,
    pub metrics: Arc<Metrics>,
    pub shutting_down: AtomicBool,
    pub created: u64,
    /// Requests being parsed, rendered and tokenized on the blocking pool at once: one per core.
    pub prepare_slots: Arc<tokio::sync::Semaphore>,
    /// The finished `/v1/responses` answers kept for their clients, and the conversations.
    pub responses: Arc<ResponseStore>,
    pub conversations: Arc<ConversationStore>,
}

impl AppState {
    pub fn shared(&self) -> &EngineShared {
        &self.engine.shared
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum Status {
    Loading,
    Ready,
    Failed(String),
}

/// A started server: its address, its load status, and the means to stop it.
pub struct RunningServer {
    addr: SocketAddr,
    status: watch::Receiver<Status>,
    stop: StopHandle,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
    engine_thread: std::thread::JoinHandle<()>,
}

/// Asks a server to stop: first gracefully, then (or on a second call to [`StopHandle::cancel_now`]) at once.
#[derive(Clone)]
pub struct StopHandle {
    shutdown: Arc<watch::Sender<bool>>,
    force: Arc<watch::Sender<bool>>,
    shared: Arc<EngineShared>,
}

impl StopHandle {
    /// Stops accepting connections; in-flight requests go on for the grace period, then are cancelled.
    pub fn shutdown(&self) {
        self.shutdown.send_replace(true);
    }

    /// Cancels every running and queued generation and closes every connection now.
    pub fn cancel_now(&self) {
        self.shared.cancel_all.store(true, Ordering::SeqCst);
        self.force.send_replace(true);
        self.shutdown();
    }
}

impl RunningServer {
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn stop_handle(&self) -> StopHandle {
        self.stop.clone()
    }

    pub fn shutdown(&self) {
        self.stop.shutdown();
    }

    pub fn status(&self) -> watch::Receiver<Status> {
        self.status.clone()
    }

    /// Waits until the model is loaded (Ok) or failed to load (Err).
    pub async fn wait_ready(&self) -> Result<()> {
        let mut status = self.status.clone();
        let status = status
            .wait_for(|s| *s != Status::Loading)
            .await
            .context("the server stopped")?
            .clone();
        match status {
            Status::Failed(message) => anyhow::bail!(message),
            _ => Ok(()),
        }
    }

    /// Waits for the server to stop, and for its engine thread to finish its last step.
    pub async fn wait(self) -> Result<()> {
        self.task
            .await
            .context("the server task failed")?
            .context("serving HTTP")?;
        // The router and with it the engine handle are gone, so the queue is closed and the engine's loop ends;
        // a generation still running was cancelled by `cancel_all`.
        let thread = self.engine_thread;
        let joined = tokio::task::spawn_blocking(move || thread.join());
        match tokio::time::timeout(Duration::from_secs(30), joined).await {
            Ok(Ok(Ok(()))) => {}
            Ok(_) => tracing::error!("the engine thread panicked"),
            Err(_) => tracing::error!("the engine thread did not stop within 30 s"),
        }
        match self.status.borrow().clone() {
            Status::Failed(message) => Err(anyhow::anyhow!(message)),
            _ => Ok(()),
        }
    }
}

/// Binds the port, starts loading the model on the engine thread, and serves. Returns once the port is bound.
pub async fn start(config: ServerConfig, factory: BackendFactory) -> Result<RunningServer> {
    anyhow::ensure!(config.max_queue >= 1, "--max-queue must be at least 1");
    if let Some(key) = &config.api_key {
        // An empty key would turn authentication off without a word, and one with surrounding spaces could never
        // match (the key a client sends is compared without them).
        anyhow::ensure!(
            !key.is_empty(),
            "--api-key (or LILY_API_KEY) is empty; leave it out to serve without a key"
        );
        anyhow::ensure!(
            key.trim() == key && key.chars().all(|c| c.is_ascii_graphic()),
            "--api-key (or LILY_API_KEY) must be visible ASCII characters without spaces around it"
        );
    }
    anyhow::ensure!(config.max_choices >= 1, "--max-choices must be at least 1");
    anyhow::ensure!(config.max_connections >= 1, "--max-connections must be at least 1");
    for origin in &config.allowed_origins {
        anyhow::ensure!(
            origin == "*" || axum::http::HeaderValue::from_str(origin).is_ok() && origin.contains("://"),
            "--allowed-origins: {origin:?} is not an origin such as https://example.com (or *)"
        );
    }
    anyhow::ensure!(
        !config.header_timeout.is_zero() && !config.body_timeout.is_zero(),
        "--header-timeout and --body-timeout must be more than 0"
    );
    anyhow::ensure!(
        config.max_request_tokens != Some(0),
        "--max-request-tokens must be at least 1"
    );
    let listener = tokio::net::TcpListener::bind((config.host.as_str(), config.port))
        .await
        .with_context(|| format!("binding {}:{}", config.host, config.port))?;
    let addr = listener.local_addr()?;

    let metrics = Arc::new(Metrics::new());
    let shared = Arc::new(EngineShared {
        metrics: metrics.clone(),
        cancel_all: AtomicBool::new(false),
        queue: JobQueue::new(config.max_queue, metrics.clone()),
        in_flight: AtomicUsize::new(0),
    });
    let state = Arc::new(AppState {
        config: config.clone(),
        ready: OnceLock::new(),
        engine: EngineHandle::new(shared.clone()),
        metrics,
        shutting_down: AtomicBool::new(false),
        created: crate::params::unix_now(),
        prepare_slots: Arc::new(tokio::sync::Semaphore::new(
            std::thread::available_parallelism().map_or(1, |n| n.get()),
        )),
        responses: Arc::new(ResponseStore::new(config.response_store_bytes)),
        conversations: Arc::new(ConversationStore::new(config.response_store_bytes)),
    });

    let (status_tx, status_rx) = watch::channel(Status::Loading);
    let status_tx = Arc::new(status_tx);
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    let (force_tx, force_rx) = watch::channel(false);
    let stop = StopHandle {
        shutdown: Arc::new(shutdown_tx),
        force: Arc::new(force_tx),
        shared: shared.clone(),
    };

    // The engine thread holds only a weak reference to the state: once the HTTP side is gone, so is the engine
    // handle, which closes the queue, and the engine's loop ends.
    let weak = Arc::downgrade(&state);
    let engine_thread = {
        let status_tx = status_tx.clone();
        let stop = stop.clone();
        std::thread::Builder::new()
            .name("lily-engine".into())
            .spawn(move || {
                // A panic while loading (a checkpoint that trips an assertion) fails the load like an error, so
                // that the server stops with it instead of answering "loading" forever.
                let loaded = std::panic::catch_unwind(AssertUnwindSafe(|| load(&config, factory, &weak, shared)))
                    .unwrap_or_else(|panic| Err(anyhow::anyhow!("{}", panic_message(&*panic))));
                match loaded {
                    Ok(Some(engine)) => {
                        status_tx.send_replace(Status::Ready);
                        engine.run();
                        // An engine that stopped after an error it could not recover from serves nothing more:
                        // the server stops and exits with the error, for a supervisor to restart it.
                        if stop.shared.queue.has_failed() {
                            let message = "the engine stopped after an internal error it could not recover from";
                            eprintln!("lily serve: {message}");
                            status_tx.send_replace(Status::Failed(message.to_string()));
                            stop.shutdown();
                        }
                    }
                    // Stopped while loading: nothing to serve, and nothing went wrong.
                    Ok(None) => {}
                    Err(error) => {
                        let message = format!("loading the model failed: {error:#}");
                        eprintln!("lily serve: {message}");
                        status_tx.send_replace(Status::Failed(message));
                        stop.shutdown();
                    }
                }
            })
            .context("starting the engine thread")?
    };

    let app = crate::routes::router(state.clone());
    let task = tokio::spawn(serve(listener, app, state, shutdown_rx, force_rx));
    Ok(RunningServer {
        addr,
        status: status_rx,
        stop,
        task,
        engine_thread,
    })
}

/// Accepts connections and serves them with hyper's HTTP/1 connection settings until shut down.
///
/// Bad clients cannot hold the server: a connection must send a request's headers within `--header-timeout`
/// (hyper's header read timeout, which also closes a keep-alive connection that stays idle that long), a body
/// within `--body-timeout` (in the routes), and at most `--max-connections` are open at once (more wait in the
/// kernel's accept queue).
///
/// Shutdown: the server keeps accepting while requests are in flight, answering new ones 503 (and `/health` 503);
/// once none is in flight, or when the grace period (`--shutdown-timeout`) ends and what is left is cancelled, it
/// stops accepting, lets each connection finish the response it is writing for up to [`DRAIN`], then closes every
/// connection, however far its client got. `StopHandle::cancel_now` closes everything at once.
async fn serve(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    state: Arc<AppState>,
    mut shutdown: watch::Receiver<bool>,
    mut force: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(state.config.header_timeout);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let slots = Arc::new(tokio::sync::Semaphore::new(state.config.max_connections));
    let mut connections = tokio::task::JoinSet::new();
    let service = hyper_util::service::TowerToHyperService::new(app);
    let mut grace_end: Option<tokio::time::Instant> = None;
    let shared = state.engine.shared.clone();
    loop {
        // Finished connection tasks are reaped so that the set does not grow.
        while connections.try_join_next().is_some() {}
        if let Some(end) = grace_end {
            if shared.in_flight.load(Ordering::SeqCst) == 0 {
                break;
            }
            if tokio::time::Instant::now() >= end {
                if !shared.cancel_all.swap(true, Ordering::SeqCst) {
                    tracing::warn!("shutdown grace period over: cancelling in-flight requests");
                }
                break;
            }
        }
        tokio::select! {
            biased;
            _ = forced(&mut force) => break,
            _ = stopping(&mut shutdown), if grace_end.is_none() => {
                state.shutting_down.store(true, Ordering::SeqCst);
                grace_end = Some(tokio::time::Instant::now() + state.config.shutdown_timeout);
            }
            _ = tokio::time::sleep(Duration::from_millis(20)), if grace_end.is_some() => {}
            (permit, accepted) = accept(&listener, &slots) => {
                let stream = match accepted {
                    Ok(stream) => stream,
                    Err(error) => {
                        // Out of file descriptors, most likely: wait for connections to close.
                        tracing::warn!("accepting a connection failed: {error}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                // Streamed tokens are small writes: without this, Nagle's algorithm holds each back for the
                // previous one's acknowledgement.
                if let Err(error) = stream.set_nodelay(true) {
                    tracing::debug!("cannot set TCP_NODELAY: {error}");
                }
                let connection = http.serve_connection(hyper_util::rt::TokioIo::new(stream), service.clone());
                let connection = graceful.watch(connection);
                connections.spawn(async move {
                    if let Err(error) = connection.await {
                        tracing::debug!("connection closed: {error}");
                    }
                    drop(permit);
                });
            }
        }
    }
    state.shutting_down.store(true, Ordering::SeqCst);
    drop(listener);
    if !*force.borrow() {
        // Cancelled jobs end within one step; their streams get their last event out during the drain.
        tokio::select! {
            _ = graceful.shutdown() => {}
            _ = tokio::time::sleep(DRAIN) => tracing::warn!("closing connections that did not finish in time"),
            _ = forced(&mut force) => {}
        }
    }
    connections.shutdown().await;
    // Nothing is served any more: whatever is still queued or running is cancelled.
    shared.cancel_all.store(true, Ordering::SeqCst);
    Ok(())
}

/// Waits for a connection slot, then for a connection.
async fn accept(
    listener: &tokio::net::TcpListener,
    slots: &Arc<tokio::sync::Semaphore>,
) -> (
    tokio::sync::OwnedSemaphorePermit,
    std::io::Result<tokio::net::TcpStream>,
) {
    let permit = slots
        .clone()
        .acquire_owned()
        .await
        .expect("the connection semaphore is never closed");
    (permit, listener.accept().await.map(|(stream, _)| stream))
}

/// Resolves once a shutdown was asked for (or the handle that could ask is gone).
async fn stopping(shutdown: &mut watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|stop| *stop).await;
}

/// Resolves once `StopHandle::cancel_now` was called (never, if the handle is gone without calling it).
async fn forced(force: &mut watch::Receiver<bool>) {
    if force.wait_for(|force| *force).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// How long connections may take, once the server stops accepting, to finish the responses they are writing.
pub const DRAIN: Duration = Duration::from_secs(1);

/// Loads tokenizer, chat template and backend; publishes what requests need into the state. `None`: the server
/// stopped while the model was loading.
fn load(
    config: &ServerConfig,
    factory: BackendFactory,
    state: &Weak<AppState>,
    shared: Arc<EngineShared>,
) -> Result<Option<Engine>> {
    let start = Instant::now();
    let dir = &config.model_dir;
    eprintln!("lily serve: loading tokenizer and chat template from {}", dir.display());
    let tokenizer = Arc::new(Tokenizer::from_dir(dir).context("loading the tokenizer")?);
    let template = ChatTemplate::from_dir(dir).context("loading the chat template")?;
    let model_config = lily_model::Config::from_dir(dir).context("reading config.json")?;
    let context = config
        .context
        .unwrap_or(DEFAULT_CONTEXT.min(model_config.max_position_embeddings));
    anyhow::ensure!(context >= 2, "--context must be at least 2 tokens");
    anyhow::ensure!(
        context <= model_config.max_position_embeddings,
        "--context {context} is beyond the model's max_position_embeddings ({})",
        model_config.max_position_embeddings
    );
    // The backend's logits are config.json's vocabulary wide (a backend that says otherwise gets a trie of its own,
    // built by the first constrained request).
    let mut structured = Arc::new(LazyStructured::new(tokenizer.clone(), model_config.vocab_size));
    if config.structured_at_start {
        // A failure to start the thread only leaves the build to the first request that needs it.
        if let Err(e) = structured.build_in_background() {
            tracing::warn!("the token trie will be built by the first constrained request: {e}");
        }
    }
    eprintln!("lily serve: loading weights (context {context} tokens) ...");
    let backend = factory(context, &config.pool).context("loading the weights")?;
    if backend.config().vocab_size != model_config.vocab_size {
        structured = Arc::new(LazyStructured::new(tokenizer.clone(), backend.config().vocab_size));
    }
    let context = backend.max_context();
    let engine = EngineOptions {
        max_prefill_tokens: Some(
            config
                .engine
                .max_prefill_tokens
                .unwrap_or_else(|| backend.prefill_budget()),
        ),
        ..config.engine
    };
    let ready = Ready {
        tokenizer: tokenizer.clone(),
        template,
        context,
        vocab_size: tokenizer.vocab_size().min(backend.config().vocab_size),
        defaults: GenerationDefaults::from_dir(dir),
        backend_name: backend.describe(),
        max_seqs: backend.max_seqs(),
        kv_tokens: backend.free_tokens(),
        max_prefill_tokens: engine.max_prefill_tokens.unwrap_or(1),
        prefix_cache: engine.prefix_cache,
        limits: RequestLimits {
            max_choices: config.max_choices,
            max_request_tokens: config
                .max_request_tokens
                .unwrap_or(context.saturating_mul(DEFAULT_REQUEST_CONTEXTS)),
        },
        special_tokens_in_content: config.special_tokens_in_content,
        structured,
    };
    eprintln!(
        "lily serve: model `{}` ready on {} in {:.1} s (context {} tokens a sequence; {} sequences at once sharing \
         {} tokens of context; {} prompt tokens an iteration; prefix cache {})",
        config.model_id,
        ready.backend_name,
        start.elapsed().as_secs_f64(),
        context,
        ready.max_seqs,
        ready.kv_tokens,
        ready.max_prefill_tokens,
        if ready.prefix_cache { "on" } else { "off" },
    );
    match state.upgrade() {
        Some(state) => {
            let _ = state.ready.set(ready);
        }
        None => return Ok(None),
    }
    Ok(Some(Engine::new(
        backend,
        tokenizer,
        config.tool_call_ids,
        shared,
        engine,
    )))
}

/// The CPU backend: `Weights::load(dir)` then `CpuModel::new`, batched over `--max-seqs` slots (default
/// [`DEFAULT_CPU_MAX_SEQS`]) sharing `--kv-tokens` tokens of context (default: a full context for each slot).
pub fn cpu_backend_factory(dir: PathBuf) -> BackendFactory {
    Box::new(move |context, pool| {
        let start = Instant::now();
        let weights = lily_model::Weights::load(&dir).with_context(|| format!("loading {}", dir.display()))?;
        eprintln!("lily serve: weights loaded in {:.1} s", start.elapsed().as_secs_f64());
        let model = lily_model::cpu::CpuModel::new(weights);
        let max_seqs = pool.max_seqs.unwrap_or(DEFAULT_CPU_MAX_SEQS);
        anyhow::ensure!(max_seqs >= 1, "--max-seqs must be at least 1");
        let kv_tokens = pool.kv_tokens.unwrap_or(max_seqs.saturating_mul(context));
        anyhow::ensure!(
            kv_tokens >= lily_model::batch::CPU_POOL_UNIT,
            "--kv-tokens must be at least {}",
            lily_model::batch::CPU_POOL_UNIT
        );
        let snapshots = pool.prefix_cache_bytes.unwrap_or(DEFAULT_CPU_PREFIX_CACHE_BYTES);
        let backend =
            lily_model::CpuBatchBackend::new(model, context, max_seqs, kv_tokens).with_snapshot_budget(snapshots);
        Ok(Box::new(backend) as Box<dyn BatchBackend>)
    })
}

/// `lily serve`: serves until SIGINT or SIGTERM (a second one cancels in-flight requests and exits at once). `backend`
/// makes the backend factory for the model directory (the binary chooses the device; [`cpu_backend_factory`] is the
/// CPU's).
pub fn run(args: ServeArgs, backend: impl FnOnce(PathBuf) -> BackendFactory) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting tokio")?;
    runtime.block_on(run_async(args, backend))
}

async fn run_async(args: ServeArgs, backend: impl FnOnce(PathBuf) -> BackendFactory) -> Result<()> {
    let (model_dir, default_id) = match &args.model {
        Some(dir) => {
            let name = dir
                .canonicalize()
                .unwrap_or_else(|_| dir.clone())
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| "lily".into());
            (dir.clone(), name)
        }
        None => (
            lily_model::default_model::locate()?,
            lily_model::default_model::NAME.to_string(),
        ),
    };
    let mut config = ServerConfig::new(model_dir.clone(), args.served_model_name.clone().unwrap_or(default_id));
    config.host = args.host.clone();
    config.port = args.port;
    config.api_key = args.api_key.clone();
    config.max_queue = args.max_queue;
    config.context = args.context;
    config.max_body_bytes = args.max_body_bytes;
    config.reasoning_field = args.reasoning_field;
    config.shutdown_timeout = seconds("--shutdown-timeout", args.shutdown_timeout)?;
    config.max_choices = args.max_choices;
    config.header_timeout = seconds("--header-timeout", args.header_timeout)?;
    config.body_timeout = seconds("--body-timeout", args.body_timeout)?;
    config.max_connections = args.max_connections;
    config.allowed_origins = args.allowed_origins.clone();
    config.special_tokens_in_content = args.allow_special_tokens_in_content;
    config.max_request_tokens = args.max_request_tokens;
    config.response_store_bytes = args
        .response_store_mib
        .checked_mul(1 << 20)
        .context("--response-store-mib is too large")?;
    let prefix_cache_bytes = match args.prefix_cache_gib {
        _ if args.no_prefix_cache => Some(0),
        Some(gib) if gib.is_finite() && gib >= 0.0 => Some((gib * (1u64 << 30) as f64) as usize),
        Some(gib) => anyhow::bail!("--prefix-cache-gib must be a number of GiB >= 0, not {gib}"),
        None => None,
    };
    config.pool = PoolOptions {
        max_seqs: args.max_seqs,
        kv_tokens: args.kv_tokens,
        prefix_cache_bytes,
    };
    anyhow::ensure!(
        args.max_prefill_tokens != Some(0),
        "--max-prefill-tokens must be at least 1"
    );
    config.engine = EngineOptions {
        max_prefill_tokens: args.max_prefill_tokens,
        prefix_cache: prefix_cache_bytes != Some(0),
        snapshot_interval: args.prefix_cache_interval,
        ..EngineOptions::default()
    };
    let server = start(config, backend(model_dir)).await?;
    eprintln!(
        "lily serve: listening on http://{} (GET /health answers 503 until the model is loaded)",
        server.local_addr()
    );
    let stop = server.stop_handle();
    let mut status = server.status();
    tokio::spawn(async move {
        let failed = async move {
            let _ = status.wait_for(|s| matches!(s, Status::Failed(_))).await.map(|_| ());
        };
        tokio::select! {
            _ = shutdown_signal() => {
                eprintln!("lily serve: shutting down: finishing in-flight requests (a second signal cancels them)");
                stop.shutdown();
                shutdown_signal().await;
                eprintln!("lily serve: second signal: cancelling in-flight requests and exiting");
                stop.cancel_now();
                // The server stops at once; should the engine thread be inside a long step, the process does not
                // wait for it.
                tokio::time::sleep(Duration::from_secs(1)).await;
                std::process::exit(1);
            }
            _ = failed => {}
        }
    });
    server.wait().await?;
    eprintln!("lily serve: stopped");
    Ok(())
}

/// The message a panic was raised with (a `&str` or `String` payload), or a stand-in.
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    let text = payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned());
    format!("panicked: {}", text.as_deref().unwrap_or("(no message)"))
}

/// A command-line number of seconds as a duration: a finite number >= 0.
fn seconds(flag: &str, value: f64) -> Result<Duration> {
    Duration::try_from_secs_f64(value)
        .map_err(|_| anyhow::anyhow!("{flag} must be a number of seconds >= 0, got {value}"))
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = terminate => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The background build leaves the trie built, and a request after it finds the same trie rather than building
    /// another.
    #[test]
    fn the_token_trie_builds_in_the_background() {
        let dir = lily_model::default_model::locate().expect("the default model");
        let tokenizer = Arc::new(Tokenizer::from_dir(&dir).expect("tokenizer"));
        let vocab_size = lily_model::Config::from_dir(&dir).expect("config").vocab_size;
        let lazy = Arc::new(LazyStructured::new(tokenizer, vocab_size));
        assert!(lazy.env.get().is_none());
        lazy.build_in_background().unwrap().join().unwrap();
        assert!(lazy.env.get().is_some());
        let built = lazy.env.get().unwrap().as_ref().expect("the trie fits the model") as *const StructuredEnv;
        assert!(std::ptr::eq(lazy.get().unwrap(), built));
    }
}
