//! Helpers for the server's integration tests: start a real server (the default tiny model, or a scripted fake
//! backend) on an ephemeral loopback port, and talk HTTP to it.

#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use lily_chat::{Tokenizer, ToolCallIds};
use lily_model::ForwardError;
use lily_model::{Backend, Config};
use lily_server::{BackendFactory, RunningServer, ServerConfig};
use serde_json::Value as Json;

pub fn model_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| lily_model::default_model::locate().expect("the default model"))
        .clone()
}

pub fn tokenizer() -> Arc<Tokenizer> {
    static TOKENIZER: OnceLock<Arc<Tokenizer>> = OnceLock::new();
    TOKENIZER
        .get_or_init(|| Arc::new(Tokenizer::from_dir(&model_dir()).expect("tokenizer")))
        .clone()
}

pub const MODEL_ID: &str = "lily-tiny-shakespeare";

pub fn config() -> ServerConfig {
    let mut config = ServerConfig::new(model_dir(), MODEL_ID.into());
    config.port = 0;
    config.context = Some(2048);
    config.tool_call_ids = ToolCallIds::Sequential;
    config.shutdown_timeout = Duration::from_secs(10);
    // Most tests send no constrained request: they leave the token trie to the first one that does.
    config.structured_at_start = false;
    config
}

pub struct TestServer {
    pub server: Option<RunningServer>,
    pub base: String,
    pub client: reqwest::Client,
}

impl TestServer {
    pub async fn start(config: ServerConfig, factory: BackendFactory) -> TestServer {
        let server = lily_server::start(config, factory).await.expect("server starts");
        let base = format!("http://{}", server.local_addr());
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(120))
            .build()
            .unwrap();
        TestServer {
            server: Some(server),
            base,
            client,
        }
    }

    /// The real default model on the CPU backend, ready.
    pub async fn real(config: ServerConfig) -> TestServer {
        let dir = config.model_dir.clone();
        let server = TestServer::start(config, lily_server::cpu_backend_factory(dir)).await;
        server.ready().await;
        server
    }

    /// A scripted backend, ready.
    pub async fn fake(config: ServerConfig, script: Script) -> TestServer {
        let server = TestServer::start(config, script.factory()).await;
        server.ready().await;
        server
    }

    pub async fn ready(&self) {
        self.server.as_ref().unwrap().wait_ready().await.expect("model loads");
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    pub async fn post(&self, path: &str, body: &Json) -> (u16, Json) {
        let response = self
            .client
            .post(self.url(path))
            .json(body)
            .send()
            .await
            .expect("request");
        let status = response.status().as_u16();
        let text = response.text().await.expect("body");
        (
            status,
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}")),
        )
    }

    pub async fn get(&self, path: &str) -> (u16, String) {
        let response = self.client.get(self.url(path)).send().await.expect("request");
        let status = response.status().as_u16();
        (status, response.text().await.unwrap())
    }

    /// Posts with `"stream": true` and returns the `data:` payloads (the last is `[DONE]`).
    pub async fn stream(&self, path: &str, body: &Json) -> (u16, Vec<String>) {
        let response = self
            .client
            .post(self.url(path))
            .json(body)
            .send()
            .await
            .expect("request");
        let status = response.status().as_u16();
        let text = response.text().await.unwrap();
        (status, sse_data(&text))
    }

    pub async fn metric(&self, line_start: &str) -> Option<f64> {
        let (_, text) = self.get("/metrics").await;
        metric_value(&text, line_start)
    }

    pub async fn shutdown(mut self) {
        let server = self.server.take().unwrap();
        server.shutdown();
        tokio::time::timeout(Duration::from_secs(60), server.wait())
            .await
            .expect("stops in time")
            .expect("stops cleanly");
    }
}

pub fn sse_data(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(str::to_string)
        .collect()
}

/// The value of the first exposition line starting with `line_start` (name and labels).
pub fn metric_value(text: &str, line_start: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(line_start))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// Parses SSE payloads (all but `[DONE]`) as JSON.
pub fn chunks(data: &[String]) -> Vec<Json> {
    assert_eq!(
        data.last().map(String::as_str),
        Some("[DONE]"),
        "stream ends with [DONE]: {data:?}"
    );
    data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

/// The error body's shape: `{"error": {"message", "type", "param", "code"}}`.
pub fn assert_error_shape(body: &Json) {
    let error = body.get("error").unwrap_or_else(|| panic!("no error object: {body}"));
    assert!(error["message"].as_str().is_some_and(|m| !m.is_empty()), "{body}");
    assert!(error["type"].is_string(), "{body}");
    assert!(error.get("param").is_some(), "{body}");
    assert!(error.get("code").is_some(), "{body}");
}

/// A backend that "generates" a fixed token sequence: after prefill and after each decode its logits put 10.0
/// on the next scripted token (then end-of-sequence forever), 8.0 on `runner_up`, and 0 elsewhere.
#[derive(Clone)]
pub struct Script {
    pub tokens: Vec<u32>,
    pub runner_up: u32,
    pub decode_delay: Duration,
    pub decodes: Arc<AtomicUsize>,
    /// Prefill takes this long per slice of `PREFILL_SLICE` prompt tokens (zero: instant).
    pub prefill_slice_delay: Duration,
    /// Prefill slices run so far.
    pub prefill_slices: Arc<AtomicUsize>,
    /// The factory waits for a message (or the sender's drop) here before it returns: tests of the loading state.
    pub load_gate: Option<Arc<Mutex<std::sync::mpsc::Receiver<()>>>>,
}

pub const EOS: u32 = 248046;

impl Script {
    pub fn new(tokens: Vec<u32>) -> Script {
        Script {
            tokens,
            runner_up: 99_999,
            decode_delay: Duration::ZERO,
            decodes: Arc::new(AtomicUsize::new(0)),
            prefill_slice_delay: Duration::ZERO,
            prefill_slices: Arc::new(AtomicUsize::new(0)),
            load_gate: None,
        }
    }

    /// The tokens of `text`, then end-of-sequence.
    pub fn text(text: &str) -> Script {
        let mut tokens = tokenizer().encode(text, false).unwrap();
        tokens.push(EOS);
        Script::new(tokens)
    }

    /// Ordinary tokens without end, `delay` per decode step: for cancellation, queueing and shutdown tests.
    pub fn endless(delay: Duration) -> Script {
        let mut s = Script::new(vec![1034; 100_000]);
        s.decode_delay = delay;
        s
    }

    pub fn factory(&self) -> BackendFactory {
        let script = self.clone();
        Box::new(move |context, _pool| {
            if let Some(gate) = &script.load_gate {
                let _ = gate.lock().unwrap().recv();
            }
            let config = Config::tiny_shape();
            let logits = vec![0.0; config.vocab_size];
            let backend = ScriptedBackend {
                config,
                script,
                pos: 0,
                logits,
                context,
            };
            Ok(Box::new(lily_model::SingleSlot::new(Box::new(backend))) as Box<dyn lily_model::BatchBackend>)
        })
    }
}

pub struct ScriptedBackend {
    config: Config,
    script: Script,
    pos: usize,
    logits: Vec<f32>,
    context: usize,
}

/// Prompt tokens per slice of the scripted backend's prefill.
pub const PREFILL_SLICE: usize = 64;

impl ScriptedBackend {
    fn prefill_slice(&mut self) {
        if !self.script.prefill_slice_delay.is_zero() {
            std::thread::sleep(self.script.prefill_slice_delay);
        }
        self.script.prefill_slices.fetch_add(1, Ordering::SeqCst);
    }

    fn set_logits(&mut self) {
        self.logits.fill(0.0);
        let next = self.script.tokens.get(self.pos).copied().unwrap_or(EOS);
        self.logits[self.script.runner_up as usize] = 8.0;
        self.logits[next as usize] = 10.0;
    }
}

impl Backend for ScriptedBackend {
    fn config(&self) -> &Config {
        &self.config
    }
    fn max_context(&self) -> usize {
        self.context
    }
    fn prefill(&mut self, prompt: &[u32]) -> Result<(), ForwardError> {
        if prompt.is_empty() {
            return Err(ForwardError::EmptyPrompt);
        }
        for _ in prompt.chunks(PREFILL_SLICE) {
            self.prefill_slice();
        }
        self.pos = 0;
        self.set_logits();
        Ok(())
    }
    fn prefill_cancellable(&mut self, prompt: &[u32], cancelled: &dyn Fn() -> bool) -> Result<bool, ForwardError> {
        if prompt.is_empty() {
            return Err(ForwardError::EmptyPrompt);
        }
        for _ in prompt.chunks(PREFILL_SLICE) {
            if cancelled() {
                return Ok(false);
            }
            self.prefill_slice();
        }
        self.pos = 0;
        self.set_logits();
        Ok(true)
    }
    /// The rest of a prompt that the engine prefills in chunks.
    fn extend(&mut self, tokens: &[u32]) -> Result<(), ForwardError> {
        for _ in tokens.chunks(PREFILL_SLICE) {
            self.prefill_slice();
        }
        self.set_logits();
        Ok(())
    }
    fn decode(&mut self, _token: u32) -> Result<(), ForwardError> {
        if !self.script.decode_delay.is_zero() {
            std::thread::sleep(self.script.decode_delay);
        }
        self.script.decodes.fetch_add(1, Ordering::SeqCst);
        self.pos += 1;
        self.set_logits();
        Ok(())
    }
    fn logits(&mut self) -> Result<&[f32], ForwardError> {
        Ok(&self.logits)
    }
    fn describe(&self) -> String {
        "scripted".into()
    }
}

/// log-softmax of the scripted distribution: `value` among one 10.0, one 8.0 and the rest 0.
pub fn scripted_logprob(value: f32, vocab: usize) -> f32 {
    let z = (10.0f64).exp() + (8.0f64).exp() + (vocab - 2) as f64;
    (value as f64 - z.ln()) as f32
}

/// Waits until `check` holds, polling; panics after `limit`.
pub async fn eventually<F, Fut>(limit: std::time::Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = std::time::Instant::now();
    while !check().await {
        assert!(start.elapsed() < limit, "timed out waiting for: {what}");
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}
