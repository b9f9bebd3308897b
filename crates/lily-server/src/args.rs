//! `lily serve` command-line arguments.

use std::path::PathBuf;

/// Where chat responses put the model's reasoning (the text inside `<think>...</think>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ReasoningField {
    /// `reasoning_content` (DeepSeek's and vLLM's name, read by most clients).
    ReasoningContent,
    /// `reasoning` (vLLM's newer name, OpenRouter's).
    Reasoning,
    /// Both fields, same text.
    Both,
}

impl ReasoningField {
    pub fn content(self) -> bool {
        matches!(self, ReasoningField::ReasoningContent | ReasoningField::Both)
    }

    pub fn reasoning(self) -> bool {
        matches!(self, ReasoningField::Reasoning | ReasoningField::Both)
    }
}

#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// Model directory (MLX 4-bit or HF bf16 safetensors). Default: the bundled lily-tiny-shakespeare.
    #[arg(long, env = "LILY_MODEL")]
    pub model: Option<PathBuf>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free port).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on /v1/*, /tokenize and /detokenize.
    #[arg(long, env = "LILY_API_KEY")]
    pub api_key: Option<String>,
    /// Requests that may wait behind the running ones; more are answered 429 with Retry-After.
    #[arg(long, default_value_t = 64)]
    pub max_queue: usize,
    /// Tokens of context per request (prompt + completion). Default: min(max_position_embeddings, 32768).
    #[arg(long)]
    pub context: Option<usize>,
    /// The model id clients see and send. Default: the model directory's name (lily-tiny-shakespeare for the
    /// default model).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Largest request body accepted, in bytes (larger: 413).
    #[arg(long, default_value_t = 8 * 1024 * 1024)]
    pub max_body_bytes: usize,
    /// Where chat responses put the model's reasoning.
    #[arg(long, value_enum, default_value = "reasoning-content")]
    pub reasoning_field: ReasoningField,
    /// Most choices one request may ask for (prompts x `n`); more: 400.
    #[arg(long, default_value_t = crate::limits::DEFAULT_MAX_CHOICES)]
    pub max_choices: usize,
    /// Most tokens one request may ask for: each choice's prompt plus its `max_tokens`, summed; more: 400.
    /// Default: 16 times the context.
    #[arg(long)]
    pub max_request_tokens: Option<usize>,
    /// Let special-token text in message content (`<|im_end|>`, `<think>`, ...) become control tokens, as the
    /// template's own do. Off: content is always plain text, so a user cannot forge turns or tool results.
    #[arg(long)]
    pub allow_special_tokens_in_content: bool,
    /// Seconds a connection may take to send a request's headers; also how long an idle keep-alive connection
    /// stays open.
    #[arg(long, default_value_t = 10.0)]
    pub header_timeout: f64,
    /// Seconds a request's body may take to arrive (longer: 408).
    #[arg(long, default_value_t = 60.0)]
    pub body_timeout: f64,
    /// Connections open at once; more wait to be accepted until one closes.
    #[arg(long, default_value_t = 512)]
    pub max_connections: usize,
    /// Origins whose browser pages may call the server (CORS), comma-separated, e.g.
    /// `https://app.example.com,http://localhost:3000`; `*` for any. Default: none.
    #[arg(long, value_delimiter = ',')]
    pub allowed_origins: Vec<String>,
    /// Sequences generated at once (the backend's slots); more wait in the queue. Default: 4 on the CPU; 1 on a
    /// GPU until its batched backend is in.
    #[arg(long)]
    pub max_seqs: Option<usize>,
    /// Tokens of context all running sequences share (each is granted its prompt plus `max_tokens` when it
    /// starts, and waits until that much is free). Default: a full `--context` for every sequence.
    #[arg(long)]
    pub kv_tokens: Option<usize>,
    /// Prompt tokens prefilled per engine iteration at most: a long prompt enters in chunks of this size between
    /// the running sequences' steps, and short prompts arriving together share one prefill pass. Default: 16384 on
    /// a GPU, 2048 on the CPU.
    #[arg(long)]
    pub max_prefill_tokens: Option<usize>,
    /// Turn the prefix cache off: every prompt is prefilled in full.
    #[arg(long)]
    pub no_prefix_cache: bool,
    /// GiB of memory the prefix cache's snapshots may take. Default: on a GPU a tenth of the memory free after the
    /// weights (the snapshots' context comes from the KV pool, taken back when new sequences need it); on the CPU 4.
    #[arg(long)]
    pub prefix_cache_gib: Option<f64>,
    /// Tokens between the snapshots a long prompt's prefill takes for the prefix cache (0: only where messages end
    /// and before the prompt's last token).
    #[arg(long, default_value_t = crate::engine::DEFAULT_SNAPSHOT_INTERVAL)]
    pub prefix_cache_interval: usize,
    /// MiB of finished `/v1/responses` answers kept in memory (least recently used dropped first), so that clients
    /// can continue one with `previous_response_id` or read it back; conversations have the same amount again; 0
    /// keeps none.
    #[arg(long, default_value_t = crate::server::DEFAULT_RESPONSE_STORE_MIB)]
    pub response_store_mib: usize,
    /// Seconds in-flight requests may run on after SIGTERM/SIGINT before they are cancelled.
    #[arg(long, default_value_t = 30.0)]
    pub shutdown_timeout: f64,
}
