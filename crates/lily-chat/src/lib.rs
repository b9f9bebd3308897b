//! Chat layer of lily for the Qwen3.5/Qwen3.6 MoE family: tokenizer, chat template, streaming detokenizer, stop
//! conditions, and the parsing of generated text into reasoning, content and tool calls.
//!
//! Request and response JSON types belong to the server; this crate deals in token ids, strings and
//! `serde_json::Value`.

pub mod output;
mod partial_match;
mod python_format;
pub mod reasoning;
pub mod stop;
pub mod stream_decoder;
pub mod template;
pub mod token_bytes;
pub mod tokenizer;
pub mod tool_call;

pub use output::{Delta, FinalOutput, OutputOptions, OutputParser, OutputStream, ToolCallDelta};
pub use reasoning::{ReasoningParser, TextSegment};
pub use stop::{FinishReason, StopChecker, StopScan, TokenCheck};
pub use stream_decoder::StreamDecoder;
pub use template::{ChatTemplate, RenderRequest, TemplateError};
pub use tokenizer::{PlainMarker, SpecialTokens, Tokenizer, TokenizerError};
pub use tool_call::{ToolCall, ToolCallEvent, ToolCallIds, ToolCallParser};

#[cfg(test)]
mod tests {
    /// The server shares one tokenizer and template across requests and moves output streams between tasks.
    #[test]
    fn shared_types_are_thread_safe() {
        fn send_sync<T: Send + Sync>() {}
        fn send<T: Send>() {}
        send_sync::<crate::Tokenizer>();
        send_sync::<crate::ChatTemplate>();
        send::<crate::OutputStream>();
    }
}
