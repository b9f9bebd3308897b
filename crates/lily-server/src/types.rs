//! Request and response bodies, in OpenAI's exact shapes (and vLLM's for `/tokenize` and `/detokenize`).
//!
//! Requests: every field is optional at the serde level, so a missing field can be reported in OpenAI's words
//! rather than serde's; unknown fields are accepted and ignored (no `deny_unknown_fields`). Wrong JSON types are
//! caught by serde and reported with the field's path.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value as Json};

/// `"stop": "x"` or `"stop": ["x", "y"]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged, expecting = "a string or an array of strings")]
pub enum StopField {
    One(String),
    Many(Vec<String>),
}

impl StopField {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            StopField::One(s) => vec![s],
            StopField::Many(v) => v,
        }
    }
}

/// The sampling fields that chat and completions requests share, before validation ([`crate::params::validate`]).
///
/// Read from the same JSON object as the request ([`crate::error::parse_json_with_sampling`]) rather than
/// `#[serde(flatten)]`-ed into it: serde_path_to_error cannot see into a flattened struct, so a wrongly typed
/// sampling field would lose its name, which the 400 error reports as `param`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct RawSampling {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub logit_bias: Option<Map<String, Json>>,
    pub seed: Option<i64>,
    pub stop: Option<StopField>,
    pub n: Option<i64>,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
}

/// A chat request's own fields; its sampling fields are a [`RawSampling`].
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ChatCompletionRequest {
    pub model: Option<String>,
    /// Kept as JSON: they go to the chat template as the client sent them (after validation).
    pub messages: Option<Vec<Json>>,
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
    pub tools: Option<Vec<Json>>,
    pub tool_choice: Option<Json>,
    pub parallel_tool_calls: Option<bool>,
    pub chat_template_kwargs: Option<Map<String, Json>>,
    pub reasoning_effort: Option<String>,
    pub response_format: Option<Json>,
    /// vLLM extension: a JSON schema, regex, choice or grammar the output must follow.
    pub structured_outputs: Option<Json>,
    /// vLLM extension: keep generating past end-of-sequence tokens (benchmarks).
    pub ignore_eos: Option<bool>,
    /// OpenAI's deprecated function-calling fields: refused (use `tools` and `tool_choice`).
    pub functions: Option<Json>,
    pub function_call: Option<Json>,
}

/// `"prompt"` of `/v1/completions`: a string, strings, token ids, or lists of token ids.
#[derive(Debug, Clone, Deserialize)]
#[serde(
    untagged,
    expecting = "a string, an array of strings, an array of token ids, or an array of arrays of token ids"
)]
pub enum PromptField {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<i64>),
    TokenLists(Vec<Vec<i64>>),
}

/// A completions request's own fields; its sampling fields are a [`RawSampling`].
#[derive(Debug, Clone, Default, Deserialize)]
pub struct CompletionRequest {
    pub model: Option<String>,
    pub prompt: Option<PromptField>,
    pub max_tokens: Option<i64>,
    pub best_of: Option<i64>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    /// Number of most likely tokens to report per position (0 reports only the chosen token's logprob).
    pub logprobs: Option<i64>,
    pub echo: Option<bool>,
    pub suffix: Option<String>,
    pub ignore_eos: Option<bool>,
    /// vLLM extensions: the output follows a JSON schema, regex, choice or grammar.
    pub response_format: Option<Json>,
    pub structured_outputs: Option<Json>,
}

/// `/tokenize`: either `prompt` (raw text) or `messages` (rendered with the chat template first).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct TokenizeRequest {
    pub model: Option<String>,
    pub prompt: Option<String>,
    pub messages: Option<Vec<Json>>,
    pub tools: Option<Vec<Json>>,
    pub add_generation_prompt: Option<bool>,
    pub add_special_tokens: Option<bool>,
    pub chat_template_kwargs: Option<Map<String, Json>>,
    pub return_token_strs: Option<bool>,
}

#[derive(Debug, Clone, Serialize)]
pub struct TokenizeResponse {
    pub count: usize,
    pub max_model_len: usize,
    pub tokens: Vec<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_strs: Option<Vec<String>>,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct DetokenizeRequest {
    pub model: Option<String>,
    pub tokens: Option<Vec<i64>>,
}

#[derive(Debug, Clone, Serialize)]
pub struct DetokenizeResponse {
    pub prompt: String,
}

// ---------------------------------------------------------------------------------------------------------------
// Responses

#[derive(Debug, Clone, Serialize)]
pub struct ModelCard {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    pub root: String,
    pub parent: Option<String>,
    pub max_model_len: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct ModelList {
    pub object: &'static str,
    pub data: Vec<ModelCard>,
}

#[derive(Debug, Clone, Serialize, Default)]
pub struct PromptTokensDetails {
    pub cached_tokens: usize,
}

#[derive(Debug, Clone, Serialize, Default)]
pub struct CompletionTokensDetails {
    /// Generated tokens of the think blocks, their tags included (0 for text completions).
    pub reasoning_tokens: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    pub prompt_tokens_details: PromptTokensDetails,
    pub completion_tokens_details: CompletionTokensDetails,
}

impl Usage {
    /// Usage of a response whose prompts took `cached_tokens` of their tokens from the prefix cache and whose
    /// completions spent `reasoning_tokens` of theirs thinking.
    pub fn new(prompt_tokens: usize, completion_tokens: usize, cached_tokens: usize, reasoning_tokens: usize) -> Usage {
        Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: PromptTokensDetails { cached_tokens },
            completion_tokens_details: CompletionTokensDetails { reasoning_tokens },
        }
    }
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ChatLogprobEntry {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<TopLogprob>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatLogprobs {
    pub content: Vec<ChatLogprobEntry>,
}

#[derive(Debug, Clone, Serialize)]
pub struct FunctionCall {
    pub name: String,
    pub arguments: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct ToolCallOut {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: FunctionCall,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatMessageOut {
    pub role: &'static str,
    pub content: Option<String>,
    pub refusal: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<Option<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<Option<String>>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCallOut>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatChoice {
    pub index: usize,
    pub message: ChatMessageOut,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: &'static str,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatCompletion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    pub usage: Usage,
    pub system_fingerprint: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct FunctionCallDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub arguments: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct ToolCallDeltaOut {
    pub index: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    pub function: FunctionCallDelta,
}

#[derive(Debug, Clone, Serialize, Default)]
pub struct ChatDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDeltaOut>>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatChunkChoice {
    pub index: usize,
    pub delta: ChatDelta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatCompletionChunk {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub system_fingerprint: Option<String>,
    pub choices: Vec<ChatChunkChoice>,
    /// Present (null or the usage) on every chunk when `stream_options.include_usage` is set, absent otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<Usage>>,
}

#[derive(Debug, Clone, Serialize, Default)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    /// Null for the prompt's first token (with `echo`), which has nothing before it.
    pub token_logprobs: Vec<Option<f64>>,
    /// The `logprobs` most likely tokens and the token itself (up to `logprobs` + 1 entries); null where
    /// `token_logprobs` is.
    pub top_logprobs: Vec<Option<Map<String, Json>>>,
    pub text_offset: Vec<usize>,
}

#[derive(Debug, Clone, Serialize)]
pub struct CompletionChoice {
    pub index: usize,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<&'static str>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Completion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub system_fingerprint: Option<String>,
    pub choices: Vec<CompletionChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<Usage>>,
}

/// OpenAI's error body: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone, Serialize)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Clone, Serialize)]
pub struct ErrorDetail {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

/// A `/v1/responses` request's own fields (OpenAI's Responses API); its sampling fields are a [`RawSampling`].
/// `previous_response_id` names a response the server kept, `conversation` a conversation; stored prompts are
/// refused.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ResponsesRequest {
    pub model: Option<String>,
    /// A string (one user message) or an array of input items; kept as JSON and checked item by item.
    pub input: Option<Json>,
    pub instructions: Option<String>,
    pub max_output_tokens: Option<i64>,
    pub stream: Option<bool>,
    pub tools: Option<Vec<Json>>,
    pub tool_choice: Option<Json>,
    pub parallel_tool_calls: Option<bool>,
    /// `{"format": {"type": "text" | "json_object" | "json_schema", ...}}`.
    pub text: Option<Json>,
    /// `{"effort": ..., "summary": ...}`.
    pub reasoning: Option<Json>,
    pub store: Option<bool>,
    pub previous_response_id: Option<String>,
    /// A prompt template stored on OpenAI's servers: refused.
    pub prompt: Option<Json>,
    pub conversation: Option<Json>,
    pub background: Option<bool>,
    pub include: Option<Vec<String>>,
    pub truncation: Option<String>,
    pub metadata: Option<Json>,
    pub top_logprobs: Option<i64>,
    /// vLLM extension, as for chat: keep generating past end-of-sequence tokens.
    pub ignore_eos: Option<bool>,
}

/// The query of `GET /v1/responses/{id}/input_items`: a page of `limit` items (1 to 100, 20 by default) in `order`
/// (`desc`, the default, or `asc`), after or before the item with the given id.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct InputItemsQuery {
    pub limit: Option<i64>,
    pub order: Option<String>,
    pub after: Option<String>,
    pub before: Option<String>,
}

/// The query of `GET /v1/responses/{id}`: `stream` reads a streamed background response's events again, those
/// after `starting_after` (a `sequence_number`); `include` and others are ignored.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct RetrieveQuery {
    pub stream: Option<bool>,
    pub starting_after: Option<u64>,
}

/// A conversation as the API shows it (its items are listed apart).
#[derive(Debug, Clone, Serialize)]
pub struct ConversationObject {
    pub id: String,
    pub object: &'static str,
    pub created_at: u64,
    pub metadata: Json,
}

/// `POST /v1/conversations` and `POST /v1/conversations/{id}` (metadata only), `POST /v1/conversations/{id}/items`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ConversationRequest {
    pub items: Option<Vec<Json>>,
    pub metadata: Option<Json>,
}

/// A page of items (`object: "list"`), with the ids of its first and last and whether more follow.
#[derive(Debug, Clone, Serialize)]
pub struct ItemList {
    pub object: &'static str,
    pub data: Vec<Json>,
    pub first_id: Option<String>,
    pub last_id: Option<String>,
    pub has_more: bool,
}

/// A response of `/v1/responses`, streamed (in the `response.*` events) or whole.
#[derive(Debug, Clone, Serialize)]
pub struct ResponseObject {
    pub id: String,
    pub object: &'static str,
    pub created_at: u64,
    /// `in_progress`, `completed`, `incomplete` (cut by `max_output_tokens`), `failed`, or `cancelled` (a background
    /// response cancelled).
    pub status: &'static str,
    pub model: String,
    pub output: Vec<ResponseItem>,
    pub usage: Option<ResponseUsage>,
    pub incomplete_details: Option<IncompleteDetails>,
    pub error: Option<Json>,
    pub instructions: Option<String>,
    pub max_output_tokens: Option<i64>,
    pub parallel_tool_calls: bool,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub tool_choice: Json,
    pub tools: Vec<Json>,
    pub text: Json,
    pub reasoning: Json,
    pub metadata: Json,
    pub store: bool,
    pub previous_response_id: Option<String>,
    pub truncation: &'static str,
    /// Answered at once and run on (`background: true`), its status read back with `GET /v1/responses/{id}`.
    pub background: bool,
    /// `{"id": ...}` of the conversation the response joins, where it names one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub conversation: Option<Json>,
}

/// An output item of a response.
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ResponseItem {
    Reasoning {
        id: String,
        summary: Vec<Json>,
        content: Vec<ResponsePart>,
        status: &'static str,
    },
    Message {
        id: String,
        status: &'static str,
        role: &'static str,
        content: Vec<ResponsePart>,
    },
    FunctionCall {
        id: String,
        call_id: String,
        name: String,
        arguments: String,
        status: &'static str,
    },
}

/// A content part of a reasoning or message item.
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ResponsePart {
    ReasoningText {
        text: String,
    },
    OutputText {
        text: String,
        annotations: Vec<Json>,
        /// The text's tokens with their logprobs, where `include` or `top_logprobs` asked for them.
        logprobs: Vec<ChatLogprobEntry>,
    },
}

#[derive(Debug, Clone, Serialize)]
pub struct ResponseUsage {
    pub input_tokens: usize,
    pub input_tokens_details: ResponseInputDetails,
    pub output_tokens: usize,
    pub output_tokens_details: CompletionTokensDetails,
    pub total_tokens: usize,
}

/// The prompt tokens taken from the prefix cache (none is ever written to a cache that bills for it).
#[derive(Debug, Clone, Serialize)]
pub struct ResponseInputDetails {
    pub cached_tokens: usize,
    pub cache_write_tokens: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct IncompleteDetails {
    pub reason: &'static str,
}
