//! Server lifecycle: bind first, load the model in the background (`/health` 503 until ready), serve, and shut
//! down gracefully (stop accepting, let in-flight requests finish for a grace period, then cancel them).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use lily_chat::{ChatTemplate, Tokenizer, ToolCallIds};
use lily_model::Backend;
use lily_structured::StructuredEnv;
use tokio::sync::watch;

use crate::args::{ReasoningField, ServeArgs};
use crate::engine::{Engine, EngineHandle, EngineShared};
use crate::metrics::Metrics;
use crate::params::GenerationDefaults;

/// Builds the backend, on the engine thread, for a context of the given number of tokens.
pub type BackendFactory = Box<dyn FnOnce(usize) -> Result<Box<dyn Backend>> + Send + 'static>;

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
    /// Requests that may wait behind the running one; more are refused with 429.
    pub max_queue: usize,
    /// Tokens of context (prompt + completion); default: min(max_position_embeddings, 32768).
    pub context: Option<usize>,
    pub max_body_bytes: usize,
    pub reasoning_field: ReasoningField,
    /// How long in-flight requests may run on after a shutdown signal before they are cancelled.
    pub shutdown_timeout: Duration,
    /// `Sequential` gives `call_0`, `call_1`, ... (tests); `Random` OpenAI-like random ids.
    pub tool_call_ids: ToolCallIds,
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
        }
    }
}

/// What requests need once the model is loaded.
pub struct Ready {
    pub tokenizer: Arc<Tokenizer>,
    pub template: ChatTemplate,
    /// Tokens of context per sequence (the backend's).
    pub context: usize,
    /// The model's vocabulary (logits) size; token ids must be below it.
    pub vocab_size: usize,
    pub defaults: GenerationDefaults,
    pub backend_name: String,
    /// The token trie for constrained decoding, built once per model; `None` when the tokenizer does not fit the
    /// model's vocabulary (constrained requests are then refused).
    pub structured: Option<Arc<StructuredEnv>>,
}

pub struct AppState {
    pub config: ServerConfig,
    pub ready: OnceLock<Ready>,
    pub engine: EngineHandle,
    pub metrics: Arc<Metrics>,
    pub shutting_down: AtomicBool,
    pub created: u64,
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
    shared: Arc<EngineShared>,
}

impl StopHandle {
    /// Stops accepting connections; in-flight requests go on for the grace period, then are cancelled.
    pub fn shutdown(&self) {
        self.shutdown.send_replace(true);
    }

    /// Cancels every running and queued generation now (and shuts down).
    pub fn cancel_now(&self) {
        self.shared.cancel_all.store(true, Ordering::SeqCst);
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
        // The router and with it the queue's sender are gone, so the engine's loop ends; a generation still
        // running was cancelled by `cancel_all`.
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
    let listener = tokio::net::TcpListener::bind((config.host.as_str(), config.port))
        .await
        .with_context(|| format!("binding {}:{}", config.host, config.port))?;
    let addr = listener.local_addr()?;

    let metrics = Arc::new(Metrics::new());
    let shared = Arc::new(EngineShared {
        metrics: metrics.clone(),
        cancel_all: AtomicBool::new(false),
        queue_depth: AtomicUsize::new(0),
        max_queue: config.max_queue,
    });
    let (sender, receiver) = std::sync::mpsc::sync_channel(config.max_queue);
    let state = Arc::new(AppState {
        config: config.clone(),
        ready: OnceLock::new(),
        engine: EngineHandle::new(sender, shared.clone()),
        metrics,
        shutting_down: AtomicBool::new(false),
        created: crate::params::unix_now(),
    });

    let (status_tx, status_rx) = watch::channel(Status::Loading);
    let status_tx = Arc::new(status_tx);
    let (shutdown_tx, mut shutdown_rx) = watch::channel(false);
    let stop = StopHandle {
        shutdown: Arc::new(shutdown_tx),
        shared: shared.clone(),
    };

    // The engine thread holds only a weak reference to the state: once the HTTP side is gone, so is the queue's
    // sender, and the engine's loop ends.
    let weak = Arc::downgrade(&state);
    let engine_thread = {
        let status_tx = status_tx.clone();
        let stop = stop.clone();
        std::thread::Builder::new()
            .name("lily-engine".into())
            .spawn(move || match load(&config, factory, &weak, shared) {
                Ok(Some(engine)) => {
                    status_tx.send_replace(Status::Ready);
                    engine.run(receiver);
                }
                // Stopped while loading: nothing to serve, and nothing went wrong.
                Ok(None) => {}
                Err(error) => {
                    let message = format!("loading the model failed: {error:#}");
                    eprintln!("lily serve: {message}");
                    status_tx.send_replace(Status::Failed(message));
                    stop.shutdown();
                }
            })
            .context("starting the engine thread")?
    };

    let app = crate::routes::router(state.clone());
    let graceful = {
        let state = state.clone();
        async move {
            let _ = shutdown_rx.wait_for(|stop| *stop).await;
            state.shutting_down.store(true, Ordering::SeqCst);
            let shared = state.engine.shared.clone();
            let grace = state.config.shutdown_timeout;
            drop(state);
            tokio::spawn(async move {
                tokio::time::sleep(grace).await;
                if !shared.cancel_all.swap(true, Ordering::SeqCst) {
                    tracing::warn!("shutdown grace period over: cancelling in-flight requests");
                }
            });
        }
    };
    drop(state);
    let task = {
        let shared = stop.shared.clone();
        tokio::spawn(async move {
            let result = axum::serve(listener, app).with_graceful_shutdown(graceful).await;
            // Nothing is listening any more: whatever is still queued or running is cancelled.
            shared.cancel_all.store(true, Ordering::SeqCst);
            result
        })
    };
    Ok(RunningServer {
        addr,
        status: status_rx,
        stop,
        task,
        engine_thread,
    })
}

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
    eprintln!("lily serve: loading weights (context {context} tokens) ...");
    let backend = factory(context).context("loading the weights")?;
    let context = backend.max_context();
    let structured = match StructuredEnv::new(tokenizer.clone(), backend.config().vocab_size) {
        Ok(env) => Some(Arc::new(env)),
        Err(e) => {
            tracing::warn!("structured outputs are unavailable: {e}");
            None
        }
    };
    let ready = Ready {
        tokenizer: tokenizer.clone(),
        template,
        context,
        vocab_size: backend.config().vocab_size,
        defaults: GenerationDefaults::from_dir(dir),
        backend_name: backend.describe(),
        structured,
    };
    eprintln!(
        "lily serve: model `{}` ready on {} in {:.1} s (context {} tokens)",
        config.model_id,
        ready.backend_name,
        start.elapsed().as_secs_f64(),
        context
    );
    match state.upgrade() {
        Some(state) => {
            let _ = state.ready.set(ready);
        }
        None => return Ok(None),
    }
    Ok(Some(Engine::new(backend, tokenizer, config.tool_call_ids, shared)))
}

/// The CPU backend: `Weights::load(dir)` then `CpuModel::new`.
pub fn cpu_backend_factory(dir: PathBuf) -> BackendFactory {
    Box::new(move |context| {
        let start = Instant::now();
        let weights = lily_model::Weights::load(&dir).with_context(|| format!("loading {}", dir.display()))?;
        eprintln!("lily serve: weights loaded in {:.1} s", start.elapsed().as_secs_f64());
        let model = lily_model::cpu::CpuModel::new(weights);
        Ok(Box::new(lily_model::CpuBackend::new(model, context)) as Box<dyn Backend>)
    })
}

/// `lily serve`: serves until SIGINT or SIGTERM (a second one cancels in-flight requests at once).
pub fn run(args: ServeArgs) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting tokio")?;
    runtime.block_on(run_async(args))
}

async fn run_async(args: ServeArgs) -> Result<()> {
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
    config.api_key = args.api_key.clone().filter(|k| !k.is_empty());
    config.max_queue = args.max_queue;
    config.context = args.context;
    config.max_body_bytes = args.max_body_bytes;
    config.reasoning_field = args.reasoning_field;
    config.shutdown_timeout = Duration::from_secs_f64(args.shutdown_timeout);
    let server = start(config, cpu_backend_factory(model_dir)).await?;
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
                eprintln!("lily serve: cancelling in-flight requests");
                stop.cancel_now();
            }
            _ = failed => {}
        }
    });
    server.wait().await?;
    eprintln!("lily serve: stopped");
    Ok(())
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
