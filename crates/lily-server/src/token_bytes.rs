//! The bytes of a single token live in the chat crate, beside the tokenizer, since constrained decoding needs them
//! too; the server's logprobs use them from there.

pub use lily_chat::token_bytes::{token_bytes, token_text};
