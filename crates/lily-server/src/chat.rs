//! `POST /v1/chat/completions`: from the request to sequences for the engine (validation, chat template,
//! tokens), and from the engine's events to OpenAI's response or chunks.

use std::sync::Arc;

use lily_chat::{Delta, FinalOutput, PlainMarker, RenderRequest, TemplateError, Tokenizer};
use lily_structured::ConstraintSpec;
use serde_json::{json, Map, Value as Json};

use crate::args::ReasoningField;
use crate::engine::{Event, OutputKind, RequestSpec, SequenceSpec};
use crate::error::ApiError;
use crate::limits::{prompt_limit, prompt_too_long};
use crate::logits::TokenLogprob;
use crate::params::{self, MAX_TOP_LOGPROBS};
use crate::server::Ready;
use crate::structured;
use crate::token_bytes::token_text;
use crate::types::*;

const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

/// A validated chat request, ready for the engine.
pub struct ChatPlan {
    pub stream: bool,
    pub include_usage: bool,
    pub logprobs: bool,
    pub parallel_tool_calls: bool,
    pub prompt_tokens: usize,
    pub sequences: Vec<SequenceSpec>,
}

/// How the request's `tool_choice` was honoured.
#[derive(Debug, Clone, PartialEq)]
enum ToolChoice {
    None,
    Auto,
    Required,
    Named(String),
}

pub fn prepare(request: ChatCompletionRequest, sampling: RawSampling, ready: &Ready) -> Result<ChatPlan, ApiError> {
    let messages = request
        .messages
        .ok_or_else(|| ApiError::invalid("messages", "`messages` is required"))?;
    for (field, value) in [
        ("functions", &request.functions),
        ("function_call", &request.function_call),
    ] {
        if value.is_some() {
            return Err(ApiError::invalid(
                field,
                format!("`{field}` (deprecated function calling) is not supported: use `tools` and `tool_choice`"),
            ));
        }
    }
    let mut messages = validate_messages(messages)?;
    let tools = validate_tools(request.tools.unwrap_or_default())?;
    let choice = tool_choice(request.tool_choice.as_ref(), &tools)?;
    let rendered_tools: Vec<Json> = match &choice {
        ToolChoice::None => Vec::new(),
        ToolChoice::Auto | ToolChoice::Required => tools.clone(),
        ToolChoice::Named(name) => tools
            .iter()
            .filter(|t| function_name(t) == Some(name.as_str()))
            .cloned()
            .collect(),
    };
    let mut instructions = Vec::new();
    match &choice {
        ToolChoice::Required => instructions
            .push("You must call at least one of the functions above in this reply, in the format given.".to_string()),
        ToolChoice::Named(name) => instructions.push(format!(
            "You must call the function `{name}` in this reply, in the format given."
        )),
        _ => {}
    }
    let format = structured::response_format(request.response_format.as_ref())?;
    if format == Some(ConstraintSpec::JsonObject) {
        let may_call = choice == ToolChoice::Auto && !rendered_tools.is_empty();
        let prefix = if may_call {
            "Unless you call a function, respond"
        } else {
            "Respond"
        };
        instructions.push(format!("{prefix} with a single valid JSON object and nothing else."));
    }
    let parallel_tool_calls = request.parallel_tool_calls.unwrap_or(true);
    // A required tool call is the constraint; otherwise `response_format` or `structured_outputs`, if any, which
    // binds the answer but not tool calls where the model may make them.
    let constraint = match &choice {
        ToolChoice::Required | ToolChoice::Named(_) => Some((
            structured::tool_calls(&rendered_tools, parallel_tool_calls),
            "tool_choice",
        )),
        _ => structured::either(
            format,
            structured::structured_outputs(request.structured_outputs.as_ref())?,
        )?
        .map(|(answer, param)| match rendered_tools.is_empty() {
            true => (answer, param),
            false => (
                structured::tool_calls_or(&rendered_tools, parallel_tool_calls, answer),
                param,
            ),
        }),
    };
    let constraint = constraint
        .map(|(spec, param)| structured::compile(ready.structured.get(), &spec, param))
        .transpose()?;
    if !instructions.is_empty() {
        add_system_instruction(&mut messages, &instructions.join("\n\n"));
    }

    let mut kwargs = validate_kwargs(request.chat_template_kwargs.unwrap_or_default())?;
    if let Some(effort) = &request.reasoning_effort {
        let thinking = match effort.as_str() {
            "none" | "minimal" => false,
            "low" | "medium" | "high" | "xhigh" => true,
            other => {
                return Err(ApiError::invalid(
                    "reasoning_effort",
                    format!("`reasoning_effort` must be one of none, minimal, low, medium, high; got {other:?}"),
                ))
            }
        };
        kwargs.entry("enable_thinking").or_insert(Json::Bool(thinking));
    }

    let (prompt_text, prompt) = render_tokens(ready, messages, &rendered_tools, kwargs, true)?;

    let (requested, param) = match (request.max_completion_tokens, request.max_tokens) {
        (Some(m), _) => (Some(m), "max_completion_tokens"),
        (None, m) => (m, "max_tokens"),
    };
    let max_tokens = params::max_tokens(requested, 1, param, "messages", prompt.len(), ready.context)?;

    let logprobs = request.logprobs.unwrap_or(false);
    let top_logprobs = match request.top_logprobs {
        None => 0,
        Some(_) if !logprobs => {
            return Err(ApiError::invalid(
                "top_logprobs",
                "`top_logprobs` needs `logprobs` set to true",
            ))
        }
        Some(k) if (0..=MAX_TOP_LOGPROBS as i64).contains(&k) => k as usize,
        Some(k) => {
            return Err(ApiError::invalid(
                "top_logprobs",
                format!("`top_logprobs` must be between 0 and {MAX_TOP_LOGPROBS}, got {k}"),
            ))
        }
    };
    let sampling = params::validate(sampling, &ready.defaults, ready.vocab_size)?;
    let stream = request.stream.unwrap_or(false);
    let include_usage = request
        .stream_options
        .as_ref()
        .and_then(|o| o.include_usage)
        .unwrap_or(false);
    if request.stream_options.is_some() && !stream {
        return Err(ApiError::invalid(
            "stream_options",
            "`stream_options` is only allowed when `stream` is true",
        ));
    }

    ready.limits.check_choices(1, sampling.n, "n")?;
    let prompt = Arc::new(prompt);
    let prompt_text: Arc<str> = prompt_text.into();
    let shared = Arc::new(RequestSpec {
        kind: OutputKind::Chat { tools: rendered_tools },
        penalties: sampling.penalties,
        stop: sampling.stop,
        ignore_eos: request.ignore_eos.unwrap_or(false),
        logprobs: logprobs.then_some(top_logprobs),
        prompt_logprobs: None,
        constraint,
    });
    let sequences: Vec<SequenceSpec> = (0..sampling.n)
        .map(|i| {
            let mut sampling_params = sampling.params.clone();
            sampling_params.seed = sampling_params.seed.wrapping_add(i as u64);
            SequenceSpec {
                index: i,
                prompt: prompt.clone(),
                prompt_text: prompt_text.clone(),
                sampling: sampling_params,
                max_tokens,
                request: shared.clone(),
            }
        })
        .collect();
    ready.limits.check_work(&sequences)?;
    Ok(ChatPlan {
        stream,
        include_usage,
        logprobs,
        parallel_tool_calls,
        prompt_tokens: prompt.len(),
        sequences,
    })
}

/// Renders messages (already validated) with the model's template and tokenizes the result; returns the prompt
/// text as the model reads it and its tokens. Text from the client (message content, tool results, tool
/// definitions, template arguments) is tokenized as plain text, so that only what the template itself adds
/// becomes control tokens: a user who writes `<|im_end|>` cannot end their turn and start a system one. With
/// `--allow-special-tokens-in-content` the whole rendered text is tokenized as one, as before. A prompt longer
/// than the context is refused as soon as tokenizing it has gone past the context.
pub fn render_tokens(
    ready: &Ready,
    mut messages: Vec<Json>,
    tools: &[Json],
    mut kwargs: Map<String, Json>,
    add_generation_prompt: bool,
) -> Result<(String, Vec<u32>), ApiError> {
    let tokenizer = &ready.tokenizer;
    let encode_error = |e: lily_chat::TokenizerError| ApiError::bad_request(format!("cannot tokenize the prompt: {e}"));
    let limit = prompt_limit(ready.context);
    if ready.special_tokens_in_content {
        let text = render(ready, messages, tools, kwargs, add_generation_prompt)?;
        let tokens = tokenizer.encode_limited(&text, limit).map_err(encode_error)?;
        let tokens = tokens.ok_or_else(|| prompt_too_long("messages", ready.context))?;
        return Ok((text, tokens));
    }
    let started = std::time::Instant::now();
    let mut tools = tools.to_vec();
    let marker = {
        let mut texts = Vec::new();
        for value in messages.iter().chain(&tools).chain(kwargs.values()) {
            collect_strings(value, &mut texts);
        }
        PlainMarker::choose(texts).ok_or_else(|| {
            ApiError::invalid(
                "messages",
                "The request uses every character of Unicode's private use area U+E000..U+F8FF; lily needs one \
                 of them free to keep message text apart from control tokens.",
            )
        })?
    };
    for value in messages.iter_mut().chain(tools.iter_mut()).chain(kwargs.values_mut()) {
        mark_strings(value, tokenizer, marker);
    }
    let marked = started.elapsed();
    let text = render(ready, messages, &tools, kwargs, add_generation_prompt)?;
    let rendered = started.elapsed();
    let tokens = tokenizer.encode_marked(&text, marker, limit).map_err(encode_error)?;
    let tokens = tokens.ok_or_else(|| prompt_too_long("messages", ready.context))?;
    let tokenized = started.elapsed();
    let text = marker.strip(&text);
    tracing::debug!(
        mark_ms = marked.as_secs_f64() * 1e3,
        render_ms = (rendered - marked).as_secs_f64() * 1e3,
        tokenize_ms = (tokenized - rendered).as_secs_f64() * 1e3,
        strip_ms = (started.elapsed() - tokenized).as_secs_f64() * 1e3,
        text_bytes = text.len(),
        "prompt rendered and tokenized"
    );
    Ok((text, tokens))
}

/// Tokenizes an assistant message of content `reply` as a chat's next request renders it, between two user
/// messages, so that the tokenizer's segment cache holds its text when that request comes: a chat client sends the
/// reply back with its next question, and only the question is then new text to encode. What the template renders
/// around the message is cached too and is a few tokens; errors are of no consequence here.
pub fn warm_reply(ready: &Ready, reply: String) {
    let user = || serde_json::json!({"role": "user", "content": ""});
    let messages = vec![
        user(),
        serde_json::json!({"role": "assistant", "content": reply}),
        user(),
    ];
    let _ = render_tokens(ready, messages, &[], Map::new(), false);
}

fn collect_strings<'a>(value: &'a Json, out: &mut Vec<&'a str>) {
    match value {
        Json::String(text) => out.push(text),
        Json::Array(items) => items.iter().for_each(|v| collect_strings(v, out)),
        Json::Object(fields) => fields.values().for_each(|v| collect_strings(v, out)),
        _ => {}
    }
}

fn mark_strings(value: &mut Json, tokenizer: &Tokenizer, marker: PlainMarker) {
    match value {
        Json::String(text) => {
            if let std::borrow::Cow::Owned(marked) = tokenizer.mark_plain(text, marker) {
                *text = marked;
            }
        }
        Json::Array(items) => items.iter_mut().for_each(|v| mark_strings(v, tokenizer, marker)),
        Json::Object(fields) => fields.values_mut().for_each(|v| mark_strings(v, tokenizer, marker)),
        _ => {}
    }
}

/// Renders messages (already validated) with the model's template; the template's own refusals are 400s.
pub fn render(
    ready: &Ready,
    messages: Vec<Json>,
    tools: &[Json],
    kwargs: Map<String, Json>,
    add_generation_prompt: bool,
) -> Result<String, ApiError> {
    let request = RenderRequest {
        messages,
        tools: (!tools.is_empty()).then(|| tools.to_vec()),
        add_generation_prompt,
        kwargs,
    };
    ready.template.render(&request).map_err(|e| match e {
        TemplateError::Raised { message } => ApiError::invalid(
            "messages",
            format!("The conversation is not valid for this model: {message}"),
        ),
        e @ (TemplateError::MessageNotObject { .. }
        | TemplateError::UnsupportedContentPart { .. }
        | TemplateError::BadTextPart { .. }
        | TemplateError::BadToolCallArguments { .. }
        | TemplateError::Render(_)) => ApiError::invalid("messages", e.to_string()),
        other => ApiError::internal(other.to_string()),
    })
}

/// Checks the template arguments the model's template reads as switches: `enable_thinking` must be a boolean
/// (the template tests `enable_thinking is false`, so any other value would silently mean "think").
pub fn validate_kwargs(kwargs: Map<String, Json>) -> Result<Map<String, Json>, ApiError> {
    for key in ["enable_thinking", "preserve_thinking"] {
        match kwargs.get(key) {
            None | Some(Json::Bool(_)) => {}
            Some(other) => {
                return Err(ApiError::invalid(
                    format!("chat_template_kwargs.{key}"),
                    format!("`chat_template_kwargs.{key}` must be true or false, got {other}"),
                ))
            }
        }
    }
    Ok(kwargs)
}

/// Checks roles and content types; `developer` becomes `system` (OpenAI's newer name for it).
pub fn validate_messages(messages: Vec<Json>) -> Result<Vec<Json>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid("messages", "`messages` must be a non-empty array"));
    }
    let mut out = Vec::with_capacity(messages.len());
    for (i, mut message) in messages.into_iter().enumerate() {
        let Some(fields) = message.as_object_mut() else {
            return Err(ApiError::invalid(
                format!("messages[{i}]"),
                format!("messages[{i}] must be an object"),
            ));
        };
        let role = match fields.get("role") {
            Some(Json::String(role)) => role.clone(),
            Some(_) => {
                return Err(ApiError::invalid(
                    format!("messages[{i}].role"),
                    format!("messages[{i}].role must be a string"),
                ))
            }
            None => {
                return Err(ApiError::invalid(
                    format!("messages[{i}].role"),
                    format!("messages[{i}] has no `role`"),
                ))
            }
        };
        if !ROLES.contains(&role.as_str()) {
            return Err(ApiError::invalid(
                format!("messages[{i}].role"),
                format!("messages[{i}].role {role:?} is not one of system, developer, user, assistant, tool"),
            ));
        }
        if role == "developer" {
            fields.insert("role".into(), Json::String("system".into()));
        }
        let param = format!("messages[{i}].content");
        match fields.get("content") {
            None | Some(Json::Null) if role == "assistant" => {}
            None | Some(Json::Null) => {
                return Err(ApiError::invalid(
                    param,
                    format!("messages[{i}] ({role}) needs a `content`"),
                ))
            }
            Some(Json::String(_)) => {}
            Some(Json::Array(parts)) => {
                for (j, part) in parts.iter().enumerate() {
                    let kind = part.get("type").and_then(Json::as_str);
                    match (kind, part.get("text")) {
                        (Some("text") | None, Some(Json::String(_))) => {}
                        (Some("text") | None, _) => {
                            return Err(ApiError::invalid(
                                format!("{param}[{j}]"),
                                format!("{param}[{j}] is a text part without a string `text`"),
                            ))
                        }
                        (Some(other), _) => {
                            return Err(ApiError::invalid(
                                format!("{param}[{j}]"),
                                format!("{param}[{j}] has type {other:?}: only text parts are supported"),
                            ))
                        }
                    }
                }
            }
            Some(_) => {
                return Err(ApiError::invalid(
                    param.clone(),
                    format!("{param} must be a string or an array of text parts"),
                ))
            }
        }
        if let Some(calls) = fields.get("tool_calls") {
            if !(calls.is_array() || calls.is_null()) {
                return Err(ApiError::invalid(
                    format!("messages[{i}].tool_calls"),
                    "`tool_calls` must be an array",
                ));
            }
        }
        out.push(message);
    }
    Ok(out)
}

fn function_name(tool: &Json) -> Option<&str> {
    tool.pointer("/function/name").and_then(Json::as_str)
}

fn validate_tools(tools: Vec<Json>) -> Result<Vec<Json>, ApiError> {
    for (i, tool) in tools.iter().enumerate() {
        let param = format!("tools[{i}]");
        if tool.get("type").and_then(Json::as_str) != Some("function") {
            return Err(ApiError::invalid(
                param,
                format!("tools[{i}].type must be \"function\""),
            ));
        }
        match function_name(tool) {
            Some(name) if !name.is_empty() => {}
            _ => {
                return Err(ApiError::invalid(
                    param,
                    format!("tools[{i}].function.name must be a non-empty string"),
                ))
            }
        }
        if let Some(parameters) = tool.pointer("/function/parameters") {
            if !parameters.is_object() {
                return Err(ApiError::invalid(
                    param,
                    format!("tools[{i}].function.parameters must be a JSON schema object"),
                ));
            }
        }
    }
    Ok(tools)
}

fn tool_choice(choice: Option<&Json>, tools: &[Json]) -> Result<ToolChoice, ApiError> {
    let bad = |message: String| Err(ApiError::invalid("tool_choice", message));
    if choice.is_some_and(|c| !c.is_null()) && tools.is_empty() {
        // As the OpenAI API: `tool_choice`, even "none" or "auto", is only allowed with `tools`.
        return bad("`tool_choice` is only allowed when `tools` are given".into());
    }
    let choice = match choice {
        None | Some(Json::Null) => {
            return Ok(if tools.is_empty() {
                ToolChoice::None
            } else {
                ToolChoice::Auto
            })
        }
        Some(Json::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return bad(format!(
                    "`tool_choice` must be none, auto, required or a function; got {other:?}"
                ))
            }
        },
        Some(Json::Object(o)) => {
            let name = o.get("function").and_then(|f| f.get("name")).and_then(Json::as_str);
            match (o.get("type").and_then(Json::as_str), name) {
                (Some("function"), Some(name)) => ToolChoice::Named(name.to_string()),
                _ => {
                    return bad(
                        "a named `tool_choice` is {\"type\": \"function\", \"function\": {\"name\": ...}}".into(),
                    )
                }
            }
        }
        Some(_) => return bad("`tool_choice` must be a string or an object".into()),
    };
    match &choice {
        ToolChoice::Named(name) if !tools.iter().any(|t| function_name(t) == Some(name)) => bad(format!(
            "`tool_choice` names the function {name:?}, which is not in `tools`"
        )),
        _ => Ok(choice),
    }
}

/// Appends an instruction to the leading system message, or adds one.
fn add_system_instruction(messages: &mut Vec<Json>, instruction: &str) {
    if let Some(first) = messages
        .first_mut()
        .filter(|m| m.get("role").and_then(Json::as_str) == Some("system"))
    {
        match first.get_mut("content") {
            Some(Json::String(text)) => {
                text.push_str("\n\n");
                text.push_str(instruction);
            }
            Some(Json::Array(parts)) => parts.push(json!({"type": "text", "text": format!("\n\n{instruction}")})),
            _ => {
                first["content"] = Json::String(instruction.to_string());
            }
        }
        return;
    }
    messages.insert(0, json!({"role": "system", "content": instruction}));
}

pub fn logprob_entry(tokenizer: &Tokenizer, lp: &TokenLogprob) -> ChatLogprobEntry {
    let (token, bytes) = token_text(tokenizer, lp.token);
    ChatLogprobEntry {
        token,
        logprob: lp.logprob,
        bytes,
        top_logprobs: lp
            .top
            .iter()
            .map(|&(id, logprob)| {
                let (token, bytes) = token_text(tokenizer, id);
                TopLogprob { token, logprob, bytes }
            })
            .collect(),
    }
}

/// Turns engine events into chat responses; one per request.
pub struct ChatResponder {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub tokenizer: Arc<Tokenizer>,
    pub reasoning_field: ReasoningField,
    pub include_usage: bool,
    pub logprobs: bool,
    pub parallel_tool_calls: bool,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Of those, the think blocks' tokens.
    pub reasoning_tokens: usize,
    /// Prompt tokens taken from the prefix cache, over the choices finished so far.
    pub cached_tokens: usize,
    /// Per choice: role sent, and logprobs not yet attached to a chunk.
    started: Vec<bool>,
    pending: Vec<Vec<ChatLogprobEntry>>,
    /// Non-streaming: all logprobs and outputs per choice.
    all_logprobs: Vec<Vec<ChatLogprobEntry>>,
    outputs: Vec<Option<FinalOutput>>,
    /// The one choice's content, once finished without tool calls: what the next turn sends back.
    pub reply: Option<String>,
}

impl ChatResponder {
    pub fn new(plan: &ChatPlan, model: String, tokenizer: Arc<Tokenizer>, reasoning_field: ReasoningField) -> Self {
        let n = plan.sequences.len();
        ChatResponder {
            id: params::random_id("chatcmpl-"),
            created: params::unix_now(),
            model,
            tokenizer,
            reasoning_field,
            include_usage: plan.include_usage,
            logprobs: plan.logprobs,
            parallel_tool_calls: plan.parallel_tool_calls,
            prompt_tokens: plan.prompt_tokens,
            completion_tokens: 0,
            reasoning_tokens: 0,
            cached_tokens: 0,
            started: vec![false; n],
            pending: vec![Vec::new(); n],
            all_logprobs: vec![Vec::new(); n],
            outputs: vec![None; n],
            reply: None,
        }
    }

    /// Keeps a lone choice's finished content as the reply the next turn will send back.
    fn keep_reply(&mut self, output: &FinalOutput) {
        if self.outputs.len() == 1
            && output.tool_calls.is_empty()
            && !output.content_is_reasoning
            && !output.content.is_empty()
        {
            self.reply = Some(output.content.clone());
        }
    }

    fn chunk(&self, choices: Vec<ChatChunkChoice>, usage: Option<Usage>) -> ChatCompletionChunk {
        ChatCompletionChunk {
            id: self.id.clone(),
            object: "chat.completion.chunk",
            created: self.created,
            model: self.model.clone(),
            system_fingerprint: None,
            choices,
            usage: self.include_usage.then_some(usage),
        }
    }

    fn delta_chunk(
        &mut self,
        index: usize,
        delta: ChatDelta,
        finish_reason: Option<&'static str>,
    ) -> ChatCompletionChunk {
        let pending = std::mem::take(&mut self.pending[index]);
        let logprobs = (self.logprobs && !pending.is_empty()).then_some(ChatLogprobs { content: pending });
        self.chunk(
            vec![ChatChunkChoice {
                index,
                delta,
                logprobs,
                finish_reason,
            }],
            None,
        )
    }

    fn to_delta(&self, delta: Delta) -> Option<ChatDelta> {
        match delta {
            Delta::Content(text) => Some(ChatDelta {
                content: Some(text),
                ..Default::default()
            }),
            Delta::Reasoning(text) => Some(ChatDelta {
                reasoning_content: self.reasoning_field.content().then(|| text.clone()),
                reasoning: self.reasoning_field.reasoning().then_some(text),
                ..Default::default()
            }),
            Delta::ToolCall(call) if !self.parallel_tool_calls && call.index > 0 => None,
            Delta::ToolCall(call) => Some(ChatDelta {
                tool_calls: Some(vec![ToolCallDeltaOut {
                    index: call.index,
                    kind: call.id.as_ref().map(|_| "function"),
                    id: call.id,
                    function: FunctionCallDelta {
                        name: call.name,
                        arguments: call.arguments,
                    },
                }]),
                ..Default::default()
            }),
        }
    }

    /// Streaming: the chunks an event produces (each the JSON of one `data:` line), and whether the stream ends.
    pub fn stream_event(&mut self, event: Event) -> (Vec<String>, bool) {
        let mut out: Vec<ChatCompletionChunk> = Vec::new();
        match event {
            Event::Token { index, deltas, logprob } => {
                self.start(index, &mut out);
                if let Some(lp) = logprob {
                    let entry = logprob_entry(&self.tokenizer, &lp);
                    self.pending[index].push(entry);
                }
                for delta in deltas {
                    if let Some(d) = self.to_delta(delta) {
                        out.push(self.delta_chunk(index, d, None));
                    }
                }
            }
            Event::Finished {
                index,
                output,
                cached_tokens,
            } => {
                self.cached_tokens += cached_tokens;
                self.keep_reply(&output);
                self.start(index, &mut out);
                for delta in output.deltas {
                    if let Some(d) = self.to_delta(delta) {
                        out.push(self.delta_chunk(index, d, None));
                    }
                }
                self.completion_tokens += output.completion_tokens;
                self.reasoning_tokens += output.reasoning_tokens;
                out.push(self.delta_chunk(index, ChatDelta::default(), Some(output.finish_reason.as_str())));
            }
            Event::Done => {
                let mut data: Vec<String> = out.iter().map(to_json).collect();
                if self.include_usage {
                    let usage = Usage::new(
                        self.prompt_tokens,
                        self.completion_tokens,
                        self.cached_tokens,
                        self.reasoning_tokens,
                    );
                    data.push(to_json(&self.chunk(Vec::new(), Some(usage))));
                }
                data.push("[DONE]".into());
                return (data, true);
            }
            Event::Error(error) => return (vec![to_json(&error.body()), "[DONE]".into()], true),
            Event::PromptLogprobs { .. } => {}
        }
        (out.iter().map(to_json).collect(), false)
    }

    fn start(&mut self, index: usize, out: &mut Vec<ChatCompletionChunk>) {
        if !self.started[index] {
            self.started[index] = true;
            let delta = ChatDelta {
                role: Some("assistant"),
                content: Some(String::new()),
                ..Default::default()
            };
            out.push(self.chunk(
                vec![ChatChunkChoice {
                    index,
                    delta,
                    logprobs: None,
                    finish_reason: None,
                }],
                None,
            ));
        }
    }

    /// Non-streaming: takes an event; `Some` once the response is complete (or failed).
    pub fn collect_event(&mut self, event: Event) -> Option<Result<ChatCompletion, ApiError>> {
        match event {
            Event::Token { index, logprob, .. } => {
                if let Some(lp) = logprob {
                    let entry = logprob_entry(&self.tokenizer, &lp);
                    self.all_logprobs[index].push(entry);
                }
                None
            }
            Event::Finished {
                index,
                output,
                cached_tokens,
            } => {
                self.cached_tokens += cached_tokens;
                self.completion_tokens += output.completion_tokens;
                self.reasoning_tokens += output.reasoning_tokens;
                self.keep_reply(&output);
                self.outputs[index] = Some(output);
                None
            }
            Event::Error(error) => Some(Err(error)),
            Event::Done => Some(Ok(self.completion())),
            // Chat requests never ask for prompt logprobs.
            Event::PromptLogprobs { .. } => None,
        }
    }

    fn completion(&mut self) -> ChatCompletion {
        let mut choices = Vec::new();
        for (index, output) in self.outputs.iter_mut().enumerate() {
            let Some(output) = output.take() else { continue };
            let mut calls = output.tool_calls;
            if !self.parallel_tool_calls {
                calls.truncate(1);
            }
            let reasoning = (!output.reasoning.is_empty()).then_some(output.reasoning);
            let content = if output.content.is_empty() && !calls.is_empty() {
                None
            } else {
                Some(output.content)
            };
            choices.push(ChatChoice {
                index,
                message: ChatMessageOut {
                    role: "assistant",
                    content,
                    refusal: None,
                    reasoning_content: self.reasoning_field.content().then(|| reasoning.clone()),
                    reasoning: self.reasoning_field.reasoning().then_some(reasoning),
                    tool_calls: calls
                        .into_iter()
                        .map(|c| ToolCallOut {
                            id: c.id,
                            kind: "function",
                            function: FunctionCall {
                                name: c.name,
                                arguments: c.arguments,
                            },
                        })
                        .collect(),
                },
                logprobs: self.logprobs.then(|| ChatLogprobs {
                    content: std::mem::take(&mut self.all_logprobs[index]),
                }),
                finish_reason: output.finish_reason.as_str(),
            });
        }
        ChatCompletion {
            id: self.id.clone(),
            object: "chat.completion",
            created: self.created,
            model: self.model.clone(),
            choices,
            usage: Usage::new(
                self.prompt_tokens,
                self.completion_tokens,
                self.cached_tokens,
                self.reasoning_tokens,
            ),
            system_fingerprint: None,
        }
    }
}

pub fn to_json<T: serde::Serialize>(value: &T) -> String {
    serde_json::to_string(value).expect("response types serialize")
}
