//! lily's OpenAI-compatible HTTP server (`lily serve`).
//!
//! Layout (after mistral.rs's server core): [`types`] holds the request and response bodies in OpenAI's shapes,
//! [`routes`] the thin HTTP handlers, [`engine`] the engine thread that owns the batch backend and runs the FIFO
//! queue's sequences together (continuous batching), [`chat`] and [`completions`] the translation between the two, and [`server`] the
//! lifecycle (bind, background load, graceful shutdown). [`responses`] maps the Responses API onto chat, and
//! [`response_store`] and [`conversations`] keep its responses and conversations.

pub mod args;
pub mod chat;
pub mod completions;
pub mod conversations;
pub mod engine;
pub mod error;
pub mod limits;
pub mod logits;
pub mod lru;
pub mod metrics;
pub mod params;
pub mod prefix_cache;
pub mod response_store;
pub mod responses;
pub mod routes;
pub mod server;
pub mod structured;
pub mod token_bytes;
pub mod types;

pub use args::{ReasoningField, ServeArgs};
pub use server::{
    cpu_backend_factory, run, start, BackendFactory, PoolOptions, RunningServer, ServerConfig, Status, StopHandle,
};
