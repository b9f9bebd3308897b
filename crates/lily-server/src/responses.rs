//! `/v1/responses` (OpenAI's Responses API) on top of the chat pipeline: a request's input items become chat
//! messages (its `instructions` the system message), its flat function tools and `text.format` become the chat
//! request's `tools` and `response_format`, and [`crate::chat::prepare`] renders, tokenizes and constrains it as it does a
//! chat request. The engine's events then become the response's output items: reasoning, a message, function
//! calls. Finished responses are kept in the [`ResponseStore`] (unless `store` is false), so a request may continue
//! one with `previous_response_id`: its context is then that response's input and output items before its own
//! input, as OpenAI's server does (the earlier `instructions` and `tools` are not carried over). A `background`
//! request is answered at once with the kept response `in_progress`, which its end replaces (see
//! `routes::run_background`). A request in a `conversation` reads the conversation's items before its input, and
//! its input and output items join the conversation once it has completed ([`ConversationStore`]). Stored prompt
//! templates are refused.

use std::collections::HashSet;
use std::sync::Arc;

use lily_chat::{Delta, FinalOutput, FinishReason, Tokenizer};
use serde_json::{json, Map, Value as Json};

use crate::chat::{logprob_entry, to_json, ChatPlan};
use crate::conversations::{Busy, ConversationStore};
use crate::engine::Event;
use crate::error::ApiError;
use crate::params::{self, MAX_TOP_LOGPROBS};
use crate::response_store::{Background, ResponseStore, StoredResponse};
use crate::routes::SseData;
use crate::types::{
    ChatCompletionRequest, ChatLogprobEntry, CompletionTokensDetails, IncompleteDetails, InputItemsQuery, ItemList,
    RawSampling, ResponseInputDetails, ResponseItem, ResponseObject, ResponsePart, ResponseUsage, ResponsesRequest,
};

/// The `include` values accepted: encrypted reasoning is asked for by clients that keep no state between turns
/// (lily's reasoning is sent in the clear in the reasoning items, so there is nothing more to include); the message
/// text's logprobs are included where asked for.
const INCLUDES: [&str; 2] = ["reasoning.encrypted_content", LOGPROBS];
const LOGPROBS: &str = "message.output_text.logprobs";

/// A Responses request translated: the chat request to prepare, what the response echoes of the request, and what
/// the stores keep of it once it is answered.
pub struct Translated {
    pub chat: ChatCompletionRequest,
    pub template: ResponseObject,
    pub kept: Kept,
}

/// What a responder keeps of a translated request: where the finished response is kept (`None` where it is not to
/// be kept), and the conversation it joins.
pub struct Kept {
    pub response: Option<Keep>,
    pub conversation: Option<AppendTo>,
}

/// The conversation a response's input and output items join once it has completed, held by the response until
/// then (see [`ConversationStore::begin`]).
pub struct AppendTo {
    conversations: Arc<ConversationStore>,
    id: String,
    input: Vec<Json>,
    busy: Busy,
}

/// What the store needs, besides the finished response, to keep it: the request's input items (each given an id)
/// and the response it continued.
pub struct Keep {
    store: Arc<ResponseStore>,
    input: Vec<Json>,
    previous: Option<Arc<StoredResponse>>,
}

/// Translates a Responses request into the chat request that [`crate::chat::prepare`] takes, and the response object it
/// will be answered with (status `in_progress`, no output yet). The response it continues, if any, comes from
/// `store`, where the response will be kept too.
pub fn translate(
    request: ResponsesRequest,
    sampling: &RawSampling,
    model: String,
    store: &Arc<ResponseStore>,
    conversations: &Arc<ConversationStore>,
) -> Result<Translated, ApiError> {
    refuse_stateful(&request)?;
    let conversation = conversation_id(&request.conversation)?;
    if conversation.is_some() && request.previous_response_id.is_some() {
        return Err(ApiError::invalid(
            "conversation",
            "`conversation` and `previous_response_id` cannot be used together",
        ));
    }
    // The conversation's items come before the input, as a continued response's do; it takes one response at a
    // time.
    let (earlier, busy) = match &conversation {
        Some(id) => {
            let busy = conversations.begin(id)?;
            (
                Some(conversations.items(id).map_err(|e| e.with_param("conversation"))?),
                Some(busy),
            )
        }
        None => (None, None),
    };
    let previous = match &request.previous_response_id {
        None => None,
        Some(id) => Some(store.get(id).ok_or_else(|| previous_not_found(id, store))?),
    };
    if let Some(previous) = previous.as_ref().filter(|p| p.response.status == "in_progress") {
        return Err(ApiError::invalid(
            "previous_response_id",
            format!(
                "Previous response with id {:?} is still in progress; continue it once it has completed",
                previous.response.id
            ),
        ));
    }
    let background = request.background == Some(true);
    let store_it = request.store.unwrap_or(true) && store.enabled();
    if background && !store_it {
        let why = match store.enabled() {
            true => "`store` must not be false",
            false => "this server keeps no responses (--response-store-mib 0)",
        };
        return Err(ApiError::invalid(
            "background",
            format!("a `background` response is read back from the server's store: {why}"),
        ));
    }
    if sampling.n.is_some_and(|n| n != 1) {
        return Err(ApiError::invalid(
            "n",
            "`n` is not a field of the Responses API: a response has one output",
        ));
    }
    if let Some(include) = request
        .include
        .iter()
        .flatten()
        .find(|i| !INCLUDES.contains(&i.as_str()))
    {
        return Err(ApiError::invalid(
            "include",
            format!("`include` value {include:?} is not supported (supported: {INCLUDES:?})"),
        ));
    }
    // Logprobs of the message's tokens where `include` asks for them or `top_logprobs` asks for alternatives.
    let top_logprobs = match request.top_logprobs {
        None => 0,
        Some(k) if (0..=MAX_TOP_LOGPROBS as i64).contains(&k) => k,
        Some(k) => {
            return Err(ApiError::invalid(
                "top_logprobs",
                format!("`top_logprobs` must be between 0 and {MAX_TOP_LOGPROBS}, got {k}"),
            ))
        }
    };
    let logprobs = top_logprobs > 0 || request.include.iter().flatten().any(|i| i == LOGPROBS);
    // Nothing is ever dropped from the input: with `auto` as with `disabled`, a prompt past the context is refused.
    let truncation = match request.truncation.as_deref() {
        None | Some("disabled") => "disabled",
        Some("auto") => "auto",
        Some(other) => {
            return Err(ApiError::invalid(
                "truncation",
                format!("`truncation` must be auto or disabled, got {other:?}"),
            ))
        }
    };
    // The items before the input: the continued response's conversation, or the conversation's.
    let earlier = match &previous {
        Some(previous) => Some(previous.conversation()),
        None => earlier,
    };
    // Their ids, which the request's own items must not repeat.
    let taken: HashSet<&str> = earlier
        .iter()
        .flatten()
        .filter_map(|item| item["id"].as_str())
        .collect();
    let input = normalized(
        match request.input.clone() {
            Some(Json::String(text)) => {
                vec![json!({"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]})]
            }
            Some(Json::Array(items)) => items,
            Some(_) => {
                return Err(ApiError::invalid(
                    "input",
                    "`input` must be a string or an array of input items",
                ))
            }
            None => return Err(ApiError::invalid("input", "`input` is required")),
        },
        |id| taken.contains(id),
    );
    let mut messages = Vec::new();
    if let Some(instructions) = &request.instructions {
        messages.push(json!({"role": "system", "content": instructions}));
    }
    match earlier {
        None => input_messages(&input, &mut messages)?,
        Some(mut conversation) => {
            // The request's own items are checked alone, so that an error names them by their index in `input`;
            // the whole conversation is then read as one, so that a turn continued across the two is one turn.
            input_messages(&input, &mut Vec::new())?;
            conversation.extend(input.iter().cloned());
            input_messages(&conversation, &mut messages)?;
        }
    }
    let tools = request.tools.clone().unwrap_or_default();
    let chat_tools: Vec<Json> = (tools.iter().enumerate())
        .filter_map(|(i, t)| chat_tool(i, t).transpose())
        .collect::<Result<_, _>>()?;
    // Clients send `"auto"` (the API's default) without tools too, which chat refuses.
    let tool_choice = match request.tool_choice.clone() {
        Some(Json::String(choice)) if chat_tools.is_empty() && (choice == "auto" || choice == "none") => None,
        choice => choice.map(chat_tool_choice).transpose()?,
    };
    let text = request
        .text
        .clone()
        .unwrap_or_else(|| json!({"format": {"type": "text"}}));
    let response_format = response_format(&text)?;
    let reasoning = request.reasoning.clone().unwrap_or(Json::Null);
    let effort = match reasoning.get("effort") {
        None | Some(Json::Null) => None,
        Some(Json::String(effort)) => Some(effort.clone()),
        Some(_) => {
            return Err(ApiError::invalid(
                "reasoning.effort",
                "`reasoning.effort` must be a string",
            ))
        }
    };
    let parallel_tool_calls = request.parallel_tool_calls.unwrap_or(true);
    let chat = ChatCompletionRequest {
        model: request.model.clone(),
        messages: Some(messages),
        max_completion_tokens: request.max_output_tokens,
        stream: request.stream,
        tools: (!chat_tools.is_empty()).then_some(chat_tools),
        tool_choice,
        parallel_tool_calls: Some(parallel_tool_calls),
        reasoning_effort: effort,
        response_format,
        logprobs: logprobs.then_some(true),
        top_logprobs: logprobs.then_some(top_logprobs),
        ignore_eos: request.ignore_eos,
        ..ChatCompletionRequest::default()
    };
    let template = ResponseObject {
        id: params::random_id("resp_"),
        object: "response",
        created_at: params::unix_now(),
        status: "in_progress",
        model,
        output: Vec::new(),
        usage: None,
        incomplete_details: None,
        error: None,
        instructions: request.instructions,
        max_output_tokens: request.max_output_tokens,
        parallel_tool_calls,
        temperature: sampling.temperature,
        top_p: sampling.top_p,
        tool_choice: request.tool_choice.unwrap_or_else(|| json!("auto")),
        tools,
        text,
        reasoning,
        metadata: request.metadata.unwrap_or_else(|| json!({})),
        store: store_it,
        previous_response_id: request.previous_response_id,
        truncation,
        background,
        conversation: conversation.as_ref().map(|id| json!({"id": id})),
    };
    let append = conversation.zip(busy).map(|(id, busy)| AppendTo {
        conversations: conversations.clone(),
        id,
        input: input.clone(),
        busy,
    });
    let keep = template.store.then(|| Keep {
        store: store.clone(),
        input,
        previous,
    });
    Ok(Translated {
        chat,
        template,
        kept: Kept {
            response: keep,
            conversation: append,
        },
    })
}

/// The error for a `previous_response_id` the store does not hold (never kept, deleted, or dropped for room), with
/// OpenAI's code for it.
fn previous_not_found(id: &str, store: &ResponseStore) -> ApiError {
    let why = match store.enabled() {
        true => "responses are kept in memory, up to the server's --response-store-mib, until the server restarts",
        false => "this server keeps no responses (--response-store-mib 0)",
    };
    let id = params::shown_id(id);
    ApiError::invalid(
        "previous_response_id",
        format!("Previous response with id {id:?} not found ({why}); send the whole conversation in `input`"),
    )
    .with_code("previous_response_not_found")
}

/// The error for a response id the store does not hold.
pub fn not_found(id: &str) -> ApiError {
    let id = params::shown_id(id);
    ApiError::not_found(format!(
        "No response with id {id:?} is kept (never stored, deleted, or dropped for room; responses are kept in \
         memory until the server restarts)"
    ))
}

/// The longest item id a client may give (longer ones are replaced).
const MAX_ID: usize = 128;

/// The most items a page of input items may hold, and how many it holds where the query does not say.
const MAX_PAGE: i64 = 100;
const DEFAULT_PAGE: i64 = 20;

/// A page of a list of items (a response's input items, a conversation's items; oldest first in `items`) as `query`
/// asks for it.
pub fn items_page(items: &[Json], query: &InputItemsQuery) -> Result<ItemList, ApiError> {
    let limit = query.limit.unwrap_or(DEFAULT_PAGE);
    if !(1..=MAX_PAGE).contains(&limit) {
        return Err(ApiError::invalid(
            "limit",
            format!("`limit` must be between 1 and {MAX_PAGE}, got {limit}"),
        ));
    }
    let newest_first = match query.order.as_deref() {
        None | Some("desc") => true,
        Some("asc") => false,
        Some(other) => {
            return Err(ApiError::invalid(
                "order",
                format!("`order` must be asc or desc, got {other:?}"),
            ))
        }
    };
    // Item i of the listing's order.
    let n = items.len();
    let at = |i: usize| match newest_first {
        true => &items[n - 1 - i],
        false => &items[i],
    };
    let position = |param: &str, id: &str| {
        (0..n).position(|i| at(i)["id"] == id).ok_or_else(|| {
            ApiError::invalid(
                param,
                format!("`{param}`: no input item of this response has id {id:?}"),
            )
        })
    };
    let start = match &query.after {
        Some(id) => position("after", id)? + 1,
        None => 0,
    };
    let end = match &query.before {
        Some(id) => position("before", id)?,
        None => n,
    };
    let end = end.max(start);
    let take = (end - start).min(limit as usize);
    // A page after a cursor (or from the first item) starts there; a page before a cursor ends there.
    let from = match query.before.is_some() && query.after.is_none() {
        true => end - take,
        false => start,
    };
    let has_more = end - start > take;
    let data: Vec<Json> = (from..from + take).map(|i| at(i).clone()).collect();
    let id_of = |item: Option<&Json>| item.and_then(|i| i["id"].as_str()).map(String::from);
    Ok(ItemList {
        object: "list",
        first_id: id_of(data.first()),
        last_id: id_of(data.last()),
        has_more,
        data,
    })
}

/// The input items as they are kept and listed: each message with its `type`, its content as parts (`input_text`,
/// or `output_text` for the assistant's) and a `status`, and every item with an `id` (by its type, as the API's
/// own items are named) that no item before it has (neither an earlier one of `items` nor one for which `taken`
/// is true: the conversation continued), so that the kept items can be listed page by page. The text the model
/// sees is the same.
pub(crate) fn normalized(mut items: Vec<Json>, taken: impl Fn(&str) -> bool) -> Vec<Json> {
    let mut fresh = HashSet::new();
    for item in items.iter_mut().filter_map(Json::as_object_mut) {
        let kind = item.get("type").and_then(Json::as_str).unwrap_or("message").to_string();
        if kind == "message" {
            item.insert("type".into(), json!("message"));
            if let Some(Json::String(text)) = item.get("content") {
                let part = match item.get("role").and_then(Json::as_str) {
                    Some("assistant") => "output_text",
                    _ => "input_text",
                };
                let content = json!([{"type": part, "text": text}]);
                item.insert("content".into(), content);
            }
            item.entry("status").or_insert(json!("completed"));
        }
        // A client's id is kept where it is new and of a sensible length.
        let id = item
            .get("id")
            .and_then(Json::as_str)
            .filter(|id| id.len() <= MAX_ID)
            .map(String::from);
        match id {
            Some(id) if !taken(&id) && !fresh.contains(&id) => {
                fresh.insert(id);
            }
            _ => {
                let prefix = match kind.as_str() {
                    "reasoning" => "rs_",
                    "function_call" => "fc_",
                    "function_call_output" => "fco_",
                    _ => "msg_",
                };
                let id = params::random_id(prefix);
                fresh.insert(id.clone());
                item.insert("id".into(), Json::String(id));
            }
        }
    }
    items
}

/// Renames the chat fields that an error from [`crate::chat::prepare`] names to the Responses fields they came from.
pub fn responses_param(mut error: ApiError) -> ApiError {
    if let Some(param) = &error.param {
        let renamed = [
            ("messages", "input"),
            ("max_completion_tokens", "max_output_tokens"),
            ("response_format", "text.format"),
            ("reasoning_effort", "reasoning.effort"),
        ]
        .iter()
        .find(|(chat, _)| param.starts_with(chat));
        if let Some((_, field)) = renamed {
            error.param = Some((*field).to_string());
        }
    }
    error
}

fn refuse_stateful(request: &ResponsesRequest) -> Result<(), ApiError> {
    if request.prompt.as_ref().is_some_and(|p| !p.is_null()) {
        return Err(ApiError::invalid(
            "prompt",
            "`prompt` (a stored prompt template): this server keeps no prompt templates",
        ));
    }
    Ok(())
}

/// The id of the conversation a request names: `"conv_..."` or `{"id": "conv_..."}`.
fn conversation_id(conversation: &Option<Json>) -> Result<Option<String>, ApiError> {
    match conversation {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(id)) => Ok(Some(id.clone())),
        Some(Json::Object(c)) => match c.get("id") {
            Some(Json::String(id)) => Ok(Some(id.clone())),
            _ => Err(ApiError::invalid("conversation", "`conversation.id` must be a string")),
        },
        Some(_) => Err(ApiError::invalid(
            "conversation",
            "`conversation` must be a conversation's id or {\"id\": ...}",
        )),
    }
}

/// Checks input items as a request's `input` (their types, roles and content), without keeping what they say.
pub(crate) fn check_input_items(items: &[Json]) -> Result<(), ApiError> {
    input_messages(items, &mut Vec::new())
}

/// The text of an input or output content part, or of a whole string content.
fn content_text(content: &Json, param: &str) -> Result<String, ApiError> {
    match content {
        Json::String(text) => Ok(text.clone()),
        Json::Array(parts) => {
            let mut text = String::new();
            for (j, part) in parts.iter().enumerate() {
                match (part.get("type").and_then(Json::as_str), part.get("text")) {
                    (Some("input_text" | "output_text" | "text" | "reasoning_text"), Some(Json::String(t))) => {
                        text.push_str(t)
                    }
                    (Some(kind), _) => {
                        return Err(ApiError::invalid(
                            format!("{param}[{j}]"),
                            format!("{param}[{j}] has type {kind:?}: only text parts are supported"),
                        ))
                    }
                    (None, _) => {
                        return Err(ApiError::invalid(
                            format!("{param}[{j}]"),
                            format!("{param}[{j}] needs a `type` and a string `text`"),
                        ))
                    }
                }
            }
            Ok(text)
        }
        _ => Err(ApiError::invalid(
            param,
            format!("{param} must be a string or an array of content parts"),
        )),
    }
}

/// A string field of input item `i`.
fn item_str(item: &Json, i: usize, field: &str) -> Result<String, ApiError> {
    match item.get(field) {
        Some(Json::String(s)) => Ok(s.clone()),
        _ => Err(ApiError::invalid(
            format!("input[{i}].{field}"),
            format!("input[{i}] needs a string `{field}`"),
        )),
    }
}

/// Appends the chat messages of the input items: messages as they are (their parts' text joined), function call
/// outputs as tool messages, and one assistant message for each assistant turn. A turn is what the model wrote
/// between two other messages (its reasoning items, its message, its function calls, in any order), the way a
/// response's output comes back in the next request, so that the template renders the turn as the model wrote it.
fn input_messages(items: &[Json], messages: &mut Vec<Json>) -> Result<(), ApiError> {
    if items.is_empty() {
        return Err(ApiError::invalid("input", "`input` must not be an empty array"));
    }
    // The assistant message of the turn being read, as an index into `messages`.
    let mut turn: Option<usize> = None;
    let assistant = |messages: &mut Vec<Json>, turn: &mut Option<usize>| -> usize {
        *turn.get_or_insert_with(|| {
            messages.push(json!({"role": "assistant", "content": Json::Null}));
            messages.len() - 1
        })
    };
    for (i, item) in items.iter().enumerate() {
        if !item.is_object() {
            return Err(ApiError::invalid(
                format!("input[{i}]"),
                format!("input[{i}] must be an object"),
            ));
        }
        let kind = item.get("type").and_then(Json::as_str).unwrap_or("message");
        match kind {
            "message" => {
                let role = item_str(item, i, "role")?;
                let param = format!("input[{i}].content");
                let content = content_text(item.get("content").unwrap_or(&Json::Null), &param)?;
                if role == "assistant" {
                    let at = assistant(messages, &mut turn);
                    append_text(&mut messages[at], "content", &content);
                } else {
                    turn = None;
                    messages.push(json!({"role": role, "content": content}));
                }
            }
            "reasoning" => {
                let param = format!("input[{i}].content");
                let text = match item.get("content") {
                    None | Some(Json::Null) => String::new(),
                    Some(content) => content_text(content, &param)?,
                };
                // Clients that keep reasoning encrypted send it back without its text.
                if !text.is_empty() {
                    let at = assistant(messages, &mut turn);
                    append_text(&mut messages[at], "reasoning_content", &text);
                }
            }
            "function_call" => {
                let call = json!({
                    "id": item_str(item, i, "call_id")?,
                    "type": "function",
                    "function": {"name": item_str(item, i, "name")?, "arguments": item_str(item, i, "arguments")?},
                });
                let at = assistant(messages, &mut turn);
                let message = &mut messages[at];
                match message.get_mut("tool_calls").and_then(Json::as_array_mut) {
                    Some(calls) => calls.push(call),
                    None => message["tool_calls"] = json!([call]),
                }
            }
            "function_call_output" => {
                let output = match item.get("output") {
                    Some(Json::String(s)) => s.clone(),
                    Some(content @ Json::Array(_)) => content_text(content, &format!("input[{i}].output"))?,
                    _ => {
                        return Err(ApiError::invalid(
                            format!("input[{i}].output"),
                            format!("input[{i}] needs a string `output`"),
                        ))
                    }
                };
                turn = None;
                let call_id = item_str(item, i, "call_id")?;
                messages.push(json!({"role": "tool", "tool_call_id": call_id, "content": output}));
            }
            other => {
                return Err(ApiError::invalid(
                    format!("input[{i}].type"),
                    format!(
                        "input[{i}] has type {other:?}: supported are message, reasoning, function_call and \
                         function_call_output"
                    ),
                ))
            }
        }
    }
    Ok(())
}

/// Appends `text` to the string field `field` of `message` (a null or missing field counts as empty).
fn append_text(message: &mut Json, field: &str, text: &str) {
    match message.get_mut(field) {
        Some(Json::String(all)) => all.push_str(text),
        _ => message[field] = Json::String(text.to_string()),
    }
}

/// The tools that OpenAI's servers run (search, code, images, MCP): a client that offers them by default still
/// gets an answer, without them.
const HOSTED_TOOLS: [&str; 7] = [
    "web_search",
    "web_search_preview",
    "file_search",
    "code_interpreter",
    "image_generation",
    "mcp",
    "computer_use_preview",
];

/// A Responses function tool (`{"type": "function", "name", "description", "parameters", "strict"}`) as a chat
/// tool (`{"type": "function", "function": {...}}`); `None` for a hosted tool, which is left out. Tools that the
/// client would run itself in shapes other than a function (custom, shell, apply_patch) are refused.
fn chat_tool(i: usize, tool: &Json) -> Result<Option<Json>, ApiError> {
    let param = format!("tools[{i}]");
    match tool.get("type").and_then(Json::as_str) {
        Some("function") => {}
        Some(hosted) if HOSTED_TOOLS.contains(&hosted) => {
            tracing::warn!("/v1/responses: the hosted tool {hosted:?} is not available here and is left out");
            return Ok(None);
        }
        Some(other) => {
            return Err(ApiError::invalid(
                param,
                format!("tools[{i}] has type {other:?}: only function tools are supported"),
            ))
        }
        None => return Err(ApiError::invalid(param, format!("tools[{i}] needs a `type`"))),
    }
    let mut function = Map::new();
    for field in ["name", "description", "parameters", "strict"] {
        if let Some(value) = tool.get(field) {
            function.insert(field.into(), value.clone());
        }
    }
    Ok(Some(json!({"type": "function", "function": function})))
}

/// A Responses `tool_choice` (`"auto"`, `"none"`, `"required"` or `{"type": "function", "name"}`) as chat's.
fn chat_tool_choice(choice: Json) -> Result<Json, ApiError> {
    match &choice {
        Json::Object(fields) if fields.get("type").and_then(Json::as_str) == Some("function") => {
            match fields.get("name") {
                Some(Json::String(name)) => Ok(json!({"type": "function", "function": {"name": name}})),
                _ => Err(ApiError::invalid(
                    "tool_choice",
                    "a function `tool_choice` needs a string `name`",
                )),
            }
        }
        _ => Ok(choice),
    }
}

/// The chat `response_format` of a Responses `text` field (`{"format": {...}}`).
fn response_format(text: &Json) -> Result<Option<Json>, ApiError> {
    let Some(format) = text.get("format").filter(|f| !f.is_null()) else {
        return Ok(None);
    };
    match format.get("type").and_then(Json::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(json!({"type": "json_object"}))),
        Some("json_schema") => {
            let mut schema = Map::new();
            for field in ["name", "description", "schema", "strict"] {
                if let Some(value) = format.get(field) {
                    schema.insert(field.into(), value.clone());
                }
            }
            Ok(Some(json!({"type": "json_schema", "json_schema": schema})))
        }
        _ => Err(ApiError::invalid(
            "text.format",
            "`text.format.type` must be one of text, json_object, json_schema",
        )),
    }
}

/// The item being streamed.
enum Open {
    Reasoning {
        id: String,
        text: String,
    },
    Message {
        id: String,
        text: String,
        logprobs: Vec<ChatLogprobEntry>,
    },
    Call {
        id: String,
        call_id: String,
        name: String,
        arguments: String,
    },
}

/// Turns engine events into a Responses answer: the whole response, or its stream of `response.*` events.
pub struct ResponsesResponder {
    response: ResponseObject,
    prompt_tokens: usize,
    completion_tokens: usize,
    reasoning_tokens: usize,
    cached_tokens: usize,
    finish: Option<FinishReason>,
    /// Whether the response streams its events.
    streamed: bool,
    /// Streaming: the next event's `sequence_number` (0: `response.created` has not gone out), and the item open.
    sequence: u64,
    open: Option<Open>,
    /// Non-streaming: the finished output.
    output: Option<FinalOutput>,
    /// The message to tokenize ahead of the next request ([`crate::chat::warm_reply`]).
    reply: Option<String>,
    /// Logprobs asked for: those of tokens whose text has not gone out yet, which go with the message's next
    /// text (or are dropped where reasoning or a function call comes next), and, not streaming, the message's.
    logprobs: bool,
    tokenizer: Arc<Tokenizer>,
    pending: Vec<ChatLogprobEntry>,
    message_logprobs: Vec<ChatLogprobEntry>,
    /// Where the finished response is kept, if it is to be, and the conversation it joins.
    keep: Option<Keep>,
    append: Option<AppendTo>,
}

impl ResponsesResponder {
    pub fn new(plan: &ChatPlan, template: ResponseObject, tokenizer: Arc<Tokenizer>, kept: Kept) -> Self {
        ResponsesResponder {
            keep: kept.response,
            append: kept.conversation,
            logprobs: plan.logprobs,
            tokenizer,
            pending: Vec::new(),
            message_logprobs: Vec::new(),
            response: template,
            prompt_tokens: plan.prompt_tokens,
            completion_tokens: 0,
            reasoning_tokens: 0,
            cached_tokens: 0,
            finish: None,
            streamed: plan.stream,
            sequence: 0,
            open: None,
            output: None,
            reply: None,
        }
    }

    fn event(&mut self, kind: &'static str, mut fields: Json) -> SseData {
        fields["type"] = json!(kind);
        fields["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        SseData {
            event: Some(kind),
            data: to_json(&fields),
        }
    }

    /// The response as it stands, with its usage and final status once finished.
    fn snapshot(&self, status: &'static str) -> ResponseObject {
        let mut response = self.response.clone();
        response.status = status;
        if status == "completed" || status == "incomplete" {
            response.usage = Some(ResponseUsage {
                input_tokens: self.prompt_tokens,
                input_tokens_details: ResponseInputDetails {
                    cached_tokens: self.cached_tokens,
                    cache_write_tokens: 0,
                },
                output_tokens: self.completion_tokens,
                output_tokens_details: CompletionTokensDetails {
                    reasoning_tokens: self.reasoning_tokens,
                },
                total_tokens: self.prompt_tokens + self.completion_tokens,
            });
        }
        if status == "incomplete" {
            response.incomplete_details = Some(IncompleteDetails {
                reason: "max_output_tokens",
            });
        }
        response
    }

    /// The status of the response, and of the item that ends: `incomplete` where `max_output_tokens` cut it.
    fn status(&self) -> &'static str {
        match self.finish {
            Some(FinishReason::Length) => "incomplete",
            _ => "completed",
        }
    }

    /// Streaming: the events an engine event produces (each named by its type, its JSON the `data:` line), and
    /// whether the stream ends.
    pub fn stream_event(&mut self, event: Event) -> (Vec<SseData>, bool) {
        let mut out = Vec::new();
        if self.sequence == 0 {
            let response = self.snapshot("in_progress");
            out.push(self.event("response.created", json!({"response": response})));
            out.push(self.event("response.in_progress", json!({"response": response})));
        }
        match event {
            Event::Token { deltas, logprob, .. } => {
                self.hold_logprob(logprob);
                self.stream_deltas(deltas, &mut out)
            }
            Event::Finished {
                mut output,
                cached_tokens,
                ..
            } => {
                self.stream_deltas(std::mem::take(&mut output.deltas), &mut out);
                self.finish = Some(output.finish_reason);
                self.close(&mut out);
                self.finished(&output, cached_tokens);
            }
            Event::Done => {
                self.close(&mut out);
                let mut response = self.snapshot(self.status());
                // Keeping it may turn a background response into its failure (no room for its final form): the
                // stream then ends as the store has it.
                self.keep(&mut response);
                let kind = match response.status {
                    "incomplete" => "response.incomplete",
                    "failed" => "response.failed",
                    _ => "response.completed",
                };
                out.push(self.event(kind, json!({"response": response})));
                return (out, true);
            }
            Event::Error(error) => {
                let body = error.body();
                let fields = json!({
                    "code": error.code,
                    "message": error.message,
                    "param": error.param,
                    "error": body.error,
                });
                self.close(&mut out);
                out.push(self.event("error", fields));
                // Clients that wait for the response's end read the error's code from `response.failed`, and
                // those of a background response also from the store.
                let mut response = self.failed(&error);
                if self.response.background {
                    self.keep(&mut response);
                }
                out.push(self.event("response.failed", json!({"response": response})));
                return (out, true);
            }
            Event::PromptLogprobs { .. } => {}
        }
        (out, false)
    }

    /// Keeps a token's logprob (where asked for) until its text goes out.
    fn hold_logprob(&mut self, logprob: Option<crate::logits::TokenLogprob>) {
        if let Some(lp) = logprob.filter(|_| self.logprobs) {
            self.pending.push(logprob_entry(&self.tokenizer, &lp));
        }
    }

    /// The logprobs that go with a delta: the held ones with message text, none with reasoning or a call (whose
    /// tokens' logprobs are dropped).
    fn logprobs_of(&mut self, delta: &Delta) -> Vec<ChatLogprobEntry> {
        match delta {
            Delta::Content(_) => std::mem::take(&mut self.pending),
            _ => {
                self.pending.clear();
                Vec::new()
            }
        }
    }

    fn stream_deltas(&mut self, deltas: Vec<Delta>, out: &mut Vec<SseData>) {
        for delta in deltas {
            let logprobs = self.logprobs_of(&delta);
            match delta {
                Delta::Reasoning(text) => self.stream_text(true, text, Vec::new(), out),
                Delta::Content(text) => self.stream_text(false, text, logprobs, out),
                Delta::ToolCall(call) if !self.response.parallel_tool_calls && call.index > 0 => {}
                Delta::ToolCall(call) => {
                    if let Some(call_id) = call.id {
                        self.close(out);
                        let open = Open::Call {
                            id: params::random_id("fc_"),
                            call_id,
                            name: call.name.unwrap_or_default(),
                            arguments: String::new(),
                        };
                        self.open_item(open, out);
                    }
                    if call.arguments.is_empty() {
                        continue;
                    }
                    let index = self.response.output.len();
                    let Some(Open::Call { id, arguments, .. }) = &mut self.open else {
                        // Argument text without a call's first delta: the parser never sends it.
                        continue;
                    };
                    arguments.push_str(&call.arguments);
                    let fields = json!({"item_id": id.clone(), "output_index": index, "delta": call.arguments});
                    out.push(self.event("response.function_call_arguments.delta", fields));
                }
            }
        }
    }

    /// Streams `text` as a delta of the reasoning item (`reasoning`) or the message being streamed (with the
    /// `logprobs` of its tokens), opening one first where the item open is of another kind.
    fn stream_text(&mut self, reasoning: bool, text: String, logprobs: Vec<ChatLogprobEntry>, out: &mut Vec<SseData>) {
        let same = match self.open {
            Some(Open::Reasoning { .. }) => reasoning,
            Some(Open::Message { .. }) => !reasoning,
            _ => false,
        };
        if !same {
            self.close(out);
            let open = match reasoning {
                true => Open::Reasoning {
                    id: params::random_id("rs_"),
                    text: String::new(),
                },
                false => Open::Message {
                    id: params::random_id("msg_"),
                    text: String::new(),
                    logprobs: Vec::new(),
                },
            };
            self.open_item(open, out);
        }
        let index = self.response.output.len();
        let (id, all) = match &mut self.open {
            Some(Open::Reasoning { id, text }) => (id, text),
            Some(Open::Message {
                id,
                text,
                logprobs: kept,
            }) => {
                kept.extend(logprobs.iter().cloned());
                (id, text)
            }
            _ => unreachable!("opened above"),
        };
        all.push_str(&text);
        let mut fields = json!({"item_id": id.clone(), "output_index": index, "content_index": 0, "delta": text});
        let kind = match reasoning {
            true => "response.reasoning_text.delta",
            false => {
                fields["logprobs"] = json!(logprobs);
                "response.output_text.delta"
            }
        };
        out.push(self.event(kind, fields));
    }

    fn item(open: &Open, status: &'static str) -> ResponseItem {
        match open {
            Open::Reasoning { id, text } => ResponseItem::Reasoning {
                id: id.clone(),
                summary: Vec::new(),
                content: match status {
                    "in_progress" => Vec::new(),
                    _ => vec![ResponsePart::ReasoningText { text: text.clone() }],
                },
                status,
            },
            Open::Message { id, text, logprobs } => ResponseItem::Message {
                id: id.clone(),
                status,
                role: "assistant",
                content: match status {
                    "in_progress" => Vec::new(),
                    _ => vec![output_text(text.clone(), logprobs.clone())],
                },
            },
            Open::Call {
                id,
                call_id,
                name,
                arguments,
            } => ResponseItem::FunctionCall {
                id: id.clone(),
                call_id: call_id.clone(),
                name: name.clone(),
                arguments: arguments.clone(),
                status,
            },
        }
    }

    fn open_item(&mut self, open: Open, out: &mut Vec<SseData>) {
        let index = self.response.output.len();
        let item = Self::item(&open, "in_progress");
        out.push(self.event(
            "response.output_item.added",
            json!({"output_index": index, "item": item}),
        ));
        let part = match &open {
            Open::Reasoning { .. } => Some(ResponsePart::ReasoningText { text: String::new() }),
            Open::Message { .. } => Some(output_text(String::new(), Vec::new())),
            Open::Call { .. } => None,
        };
        if let Some(part) = part {
            let id = Self::id_of(&open);
            let fields = json!({"item_id": id, "output_index": index, "content_index": 0, "part": part});
            out.push(self.event("response.content_part.added", fields));
        }
        self.open = Some(open);
    }

    fn id_of(open: &Open) -> String {
        match open {
            Open::Reasoning { id, .. } | Open::Message { id, .. } | Open::Call { id, .. } => id.clone(),
        }
    }

    /// Ends the item being streamed: its `done` events, and it joins the response's output.
    fn close(&mut self, out: &mut Vec<SseData>) {
        let Some(open) = self.open.take() else {
            return;
        };
        let index = self.response.output.len();
        let id = Self::id_of(&open);
        match &open {
            Open::Reasoning { text, .. } => {
                let fields = json!({"item_id": id, "output_index": index, "content_index": 0, "text": text});
                out.push(self.event("response.reasoning_text.done", fields));
                let part = ResponsePart::ReasoningText { text: text.clone() };
                let fields = json!({"item_id": id, "output_index": index, "content_index": 0, "part": part});
                out.push(self.event("response.content_part.done", fields));
            }
            Open::Message { text, logprobs, .. } => {
                let fields = json!({
                    "item_id": id, "output_index": index, "content_index": 0, "text": text, "logprobs": logprobs,
                });
                out.push(self.event("response.output_text.done", fields));
                let part = output_text(text.clone(), logprobs.clone());
                let fields = json!({"item_id": id, "output_index": index, "content_index": 0, "part": part});
                out.push(self.event("response.content_part.done", fields));
            }
            Open::Call { name, arguments, .. } => {
                let fields = json!({"item_id": id, "output_index": index, "name": name, "arguments": arguments});
                out.push(self.event("response.function_call_arguments.done", fields));
            }
        }
        let item = Self::item(&open, self.status());
        out.push(self.event(
            "response.output_item.done",
            json!({"output_index": index, "item": item}),
        ));
        self.response.output.push(item);
    }

    /// Non-streaming: takes an event; `Some` once the response is complete (or failed).
    pub fn collect_event(&mut self, event: Event) -> Option<Result<ResponseObject, ApiError>> {
        match event {
            Event::Token { deltas, logprob, .. } => {
                self.hold_logprob(logprob);
                self.collect_logprobs(&deltas);
                None
            }
            Event::PromptLogprobs { .. } => None,
            Event::Finished {
                output, cached_tokens, ..
            } => {
                self.collect_logprobs(&output.deltas);
                self.finish = Some(output.finish_reason);
                self.finished(&output, cached_tokens);
                self.output = Some(output);
                None
            }
            Event::Error(error) => {
                // A background response's client reads the failure from the store.
                if self.response.background {
                    let mut response = self.failed(&error);
                    self.keep(&mut response);
                }
                Some(Err(error))
            }
            Event::Done => {
                if let Some(output) = self.output.take() {
                    self.response.output = self.output_items(output);
                }
                let mut response = self.snapshot(self.status());
                self.keep(&mut response);
                Some(Ok(response))
            }
        }
    }

    /// Keeps the finished response in the store, before the client can read its id: a client may continue it
    /// as soon as it has the answer. (A response whose client left is not kept, nor a failed one unless it ran in
    /// the background, whose client reads its failure from the store.) Where it cannot be
    /// kept (no room), the response says `store: false`.
    /// A background response's final form replaces the one kept while it ran (unless that was deleted meanwhile);
    /// one too large for the store is replaced by its failure, so its client does not poll forever, and `response`
    /// becomes that failure.
    fn keep(&mut self, response: &mut ResponseObject) {
        let completed = self.keep_response(response);
        let Some(AppendTo {
            conversations,
            id,
            mut input,
            busy,
        }) = self.append.take()
        else {
            return;
        };
        // Only a response that has completed joins its conversation (a background one as its client will read
        // it), and the conversation is free for the next response once it has.
        if completed {
            input.extend(
                response
                    .output
                    .iter()
                    .filter_map(|item| serde_json::to_value(item).ok()),
            );
            if !conversations.append(&id, input) {
                tracing::warn!(conversation = %id, "a response's items could not join its conversation");
            }
        }
        drop(busy);
    }

    /// Keeps the response in the store where it is to be kept; whether it has completed (or is incomplete) as
    /// its client reads it.
    fn keep_response(&mut self, response: &mut ResponseObject) -> bool {
        let completed = response.status == "completed" || response.status == "incomplete";
        let Some(Keep { store, input, previous }) = self.keep.take() else {
            return completed;
        };
        let stored = StoredResponse::new(response.clone(), input, previous);
        if !response.background {
            if !store.insert(stored) {
                tracing::warn!(id = %response.id, "no room in the response store for a response's conversation");
                response.store = false;
            }
            return completed;
        }
        let (input, previous) = (stored.input.clone(), stored.previous.clone());
        if store.replace(stored) {
            return completed;
        }
        // The final form found no room (or the response was deleted): its client reads a failure instead, or
        // nothing at all, never an `in_progress` that does not end.
        let error = ApiError::internal("the response is larger than the room in the server's response store");
        let mut failed = self.failed(&error);
        failed.output.clear();
        if store.replace_without_events(StoredResponse::new(failed.clone(), input, previous)) {
            // Its live stream, if any, ends with the failure its client would read from the store.
            *response = failed;
        } else {
            store.remove(&response.id);
        }
        false
    }

    /// A background request, accepted: keeps the response as it stands (`in_progress`, no output) and registers it
    /// as running; returns it, the answer to the request, and what the task that runs it holds. `None` for a
    /// request that is not in the background; an error where the store has no room for it.
    pub fn accept_background(&mut self) -> Option<Result<(ResponseObject, Background), ApiError>> {
        let keep = self.keep.as_ref().filter(|_| self.response.background)?;
        let response = self.snapshot("in_progress");
        // Registered first, so that no other response's arrival drops it for room.
        let background = keep.store.start_background(&response.id, self.streamed);
        let stored = StoredResponse::new(response.clone(), keep.input.clone(), keep.previous.clone());
        if !keep.store.insert(stored) {
            return Some(Err(ApiError::invalid(
                "background",
                "the response store has no room for this background response (--response-store-mib)",
            )));
        }
        Some(Ok((response, background)))
    }

    /// A background response cancelled (`POST /v1/responses/{id}/cancel`): kept as `cancelled`, without output.
    /// Returns the events that close a streamed one's open item (there is no stream event for a cancel: readers
    /// see the stream end, and the response's status says why).
    pub fn cancelled(&mut self) -> Vec<SseData> {
        let mut response = self.snapshot("cancelled");
        response.output.clear();
        self.keep(&mut response);
        let mut out = Vec::new();
        if self.streamed && self.sequence > 0 {
            self.close(&mut out);
        }
        out
    }

    /// The response as a failure ends it, with the error's code and message.
    fn failed(&self, error: &ApiError) -> ResponseObject {
        let mut response = self.snapshot("failed");
        response.error = Some(json!({"code": error.code.unwrap_or(error.kind), "message": error.message}));
        response
    }

    /// Not streaming: the held logprobs that go with `deltas` join the message's.
    fn collect_logprobs(&mut self, deltas: &[Delta]) {
        for delta in deltas {
            let logprobs = self.logprobs_of(delta);
            self.message_logprobs.extend(logprobs);
        }
    }

    /// Counts a finished generation's tokens, and keeps its message as the reply the next request will send back
    /// (when it is the whole answer: no function calls, not the unfinished reasoning's copy).
    fn finished(&mut self, output: &FinalOutput, cached_tokens: usize) {
        self.cached_tokens += cached_tokens;
        self.completion_tokens += output.completion_tokens;
        self.reasoning_tokens += output.reasoning_tokens;
        if output.tool_calls.is_empty() && !output.content_is_reasoning && !output.content.is_empty() {
            self.reply = Some(output.content.clone());
        }
    }

    /// The reply to tokenize ahead of the next request, once the response is complete.
    pub fn take_reply(&mut self) -> Option<String> {
        self.reply.take()
    }

    /// The output items of a finished generation: its reasoning, its message (unless it only called tools) and
    /// its function calls; the last is `incomplete` where `max_output_tokens` cut it.
    fn output_items(&mut self, output: FinalOutput) -> Vec<ResponseItem> {
        let mut items = Vec::new();
        if !output.reasoning.is_empty() {
            items.push(ResponseItem::Reasoning {
                id: params::random_id("rs_"),
                summary: Vec::new(),
                content: vec![ResponsePart::ReasoningText { text: output.reasoning }],
                status: "completed",
            });
        }
        let mut calls = output.tool_calls;
        if !self.response.parallel_tool_calls {
            calls.truncate(1);
        }
        if !output.content.is_empty() || calls.is_empty() {
            items.push(ResponseItem::Message {
                id: params::random_id("msg_"),
                status: "completed",
                role: "assistant",
                content: vec![output_text(output.content, std::mem::take(&mut self.message_logprobs))],
            });
        }
        for call in calls {
            items.push(ResponseItem::FunctionCall {
                id: params::random_id("fc_"),
                call_id: call.id,
                name: call.name,
                arguments: call.arguments,
                status: "completed",
            });
        }
        if let Some(
            ResponseItem::Reasoning { status, .. }
            | ResponseItem::Message { status, .. }
            | ResponseItem::FunctionCall { status, .. },
        ) = items.last_mut()
        {
            *status = self.status();
        }
        items
    }
}

fn output_text(text: String, logprobs: Vec<ChatLogprobEntry>) -> ResponsePart {
    ResponsePart::OutputText {
        text,
        annotations: Vec::new(),
        logprobs,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn translate_json(body: Json) -> Result<Translated, ApiError> {
        translate_in(&Arc::new(ResponseStore::new(1 << 20)), body)
    }

    fn translate_in(store: &Arc<ResponseStore>, body: Json) -> Result<Translated, ApiError> {
        translate_with(store, &Arc::new(ConversationStore::new(1 << 20)), body)
    }

    fn translate_with(
        store: &Arc<ResponseStore>,
        conversations: &Arc<ConversationStore>,
        body: Json,
    ) -> Result<Translated, ApiError> {
        let request: ResponsesRequest = serde_json::from_value(body.clone()).unwrap();
        let sampling: RawSampling = serde_json::from_value(body).unwrap();
        translate(request, &sampling, "m".into(), store, conversations)
    }

    /// Answers `body` in `store` with the generation of [`events`], not streamed (or streamed), and returns the
    /// response's JSON.
    fn answer_in(store: &Arc<ResponseStore>, body: Json, stream: bool) -> Json {
        let t = translate_in(store, body).unwrap();
        let mut responder = ResponsesResponder::new(&plan(false), t.template, tokenizer(), t.kept);
        let mut response = None;
        for event in events() {
            if stream {
                let (data, done) = responder.stream_event(event);
                if done {
                    response = Some(parse(data.last().unwrap())["response"].clone());
                }
            } else if let Some(result) = responder.collect_event(event) {
                response = Some(serde_json::to_value(result.unwrap()).unwrap());
            }
        }
        response.expect("a response at Done")
    }

    #[test]
    fn a_background_response_is_kept_while_it_runs_and_replaced_at_its_end() {
        let store = Arc::new(ResponseStore::new(1 << 20));
        let start = |store: &Arc<ResponseStore>| {
            let t = translate_in(store, json!({"input": "hi", "background": true})).unwrap();
            let mut responder = ResponsesResponder::new(&plan(false), t.template, tokenizer(), t.kept);
            let (accepted, background) = responder.accept_background().expect("a background request").unwrap();
            assert_eq!((accepted.status, accepted.background), ("in_progress", true));
            let id = accepted.id.clone();
            assert_eq!(store.get(&id).unwrap().response.status, "in_progress");
            (responder, background, id)
        };
        // It ends: its final form replaces it.
        let (mut responder, background, id) = start(&store);
        let error = translate_in(&store, json!({"input": "more", "previous_response_id": id}))
            .err()
            .unwrap();
        assert_eq!(error.param.as_deref(), Some("previous_response_id"));
        for event in events() {
            responder.collect_event(event);
        }
        drop(background);
        let done = store.get(&id).unwrap();
        assert_eq!(done.response.status, "completed");
        assert_eq!(done.response.output.len(), 3);
        assert!(translate_in(&store, json!({"input": "more", "previous_response_id": id})).is_ok());
        // It fails: kept as failed, with the error's code.
        let (mut responder, _background, id) = start(&store);
        responder.collect_event(Event::Error(ApiError::engine_failed()));
        let failed = store.get(&id).unwrap();
        assert_eq!(failed.response.status, "failed");
        assert_eq!(failed.response.error.as_ref().unwrap()["code"], "engine_failed");
        // It is cancelled: kept as cancelled.
        let (mut responder, _background, id) = start(&store);
        responder.cancelled();
        assert_eq!(store.get(&id).unwrap().response.status, "cancelled");
        // It is deleted while it runs: its end does not bring it back.
        let (mut responder, _background, id) = start(&store);
        assert!(store.remove(&id));
        for event in events() {
            responder.collect_event(event);
        }
        assert!(store.get(&id).is_none());
        // A response that is not in the background is not accepted early.
        let t = translate_in(&store, json!({"input": "hi"})).unwrap();
        let mut responder = ResponsesResponder::new(&plan(false), t.template, tokenizer(), t.kept);
        assert!(responder.accept_background().is_none());
    }

    #[test]
    fn a_response_in_a_conversation_reads_its_items_and_joins_it() {
        let store = Arc::new(ResponseStore::new(1 << 20));
        let conversations = Arc::new(ConversationStore::new(1 << 20));
        let c = conversations
            .create(None, Some(vec![json!({"role": "user", "content": "Weather?"})]))
            .unwrap();
        let body = json!({"input": "And tomorrow?", "conversation": {"id": c.id}, "store": false});
        let t = translate_with(&store, &conversations, body).unwrap();
        assert_eq!(t.template.conversation, Some(json!({"id": c.id})));
        let messages = t.chat.messages.clone().unwrap();
        assert_eq!(messages.len(), 2);
        assert_eq!(
            (&messages[0]["content"], &messages[1]["content"]),
            (&json!("Weather?"), &json!("And tomorrow?"))
        );
        let mut responder = ResponsesResponder::new(&plan(false), t.template, tokenizer(), t.kept);
        for event in events() {
            responder.collect_event(event);
        }
        // The conversation now holds its item, the input and the output (reasoning, message, call).
        let items = conversations.items(&c.id).unwrap();
        let types: Vec<&str> = items.iter().map(|i| i["type"].as_str().unwrap()).collect();
        assert_eq!(types, ["message", "message", "reasoning", "message", "function_call"]);
        // A failed response does not join it, and an unknown conversation is 404.
        let t = translate_with(&store, &conversations, json!({"input": "x", "conversation": c.id})).unwrap();
        let mut responder = ResponsesResponder::new(&plan(false), t.template, tokenizer(), t.kept);
        responder.collect_event(Event::Error(ApiError::engine_failed()));
        assert_eq!(conversations.items(&c.id).unwrap().len(), 5);
        let error = translate_with(&store, &conversations, json!({"input": "x", "conversation": "conv_x"}))
            .err()
            .unwrap();
        assert_eq!(
            (error.status.as_u16(), error.param.as_deref()),
            (404, Some("conversation"))
        );
    }

    #[test]
    fn kept_input_items_are_normalized_with_ids_of_their_own() {
        let store = Arc::new(ResponseStore::new(1 << 20));
        let first = answer_in(&store, json!({"input": "Weather?"}), false);
        let id = first["id"].as_str().unwrap();
        let output_id = first["output"][1]["id"].clone();
        let t = translate_in(
            &store,
            json!({"previous_response_id": id, "input": [
                {"role": "user", "content": "Again?", "id": "x"},
                {"role": "assistant", "content": "Yes.", "id": "x"},
                // An output item sent back although the response is continued: its id is taken.
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi!"}], "id": output_id},
            ]}),
        )
        .unwrap();
        let input = t.kept.response.unwrap().input;
        assert_eq!(input[0]["id"], "x");
        assert_eq!(input[0]["type"], "message");
        assert_eq!(input[0]["content"], json!([{"type": "input_text", "text": "Again?"}]));
        assert_eq!(input[0]["status"], "completed");
        assert_eq!(input[1]["content"], json!([{"type": "output_text", "text": "Yes."}]));
        assert_ne!(input[1]["id"], "x");
        assert_ne!(input[2]["id"], output_id);
        // The model reads the same text.
        let messages = t.chat.messages.unwrap();
        assert_eq!(messages[messages.len() - 2]["content"], "Again?");
    }

    #[test]
    fn a_background_response_too_large_for_the_store_ends_failed() {
        // Room for the accepted response, not for its output.
        let store = Arc::new(ResponseStore::new(16 << 10));
        let output = || FinalOutput {
            deltas: Vec::new(),
            reasoning: String::new(),
            content: "x".repeat(64 << 10),
            content_is_reasoning: false,
            tool_calls: Vec::new(),
            finish_reason: FinishReason::Stop,
            completion_tokens: 1,
            reasoning_tokens: 0,
        };
        let finished = |output| Event::Finished {
            index: 0,
            output,
            cached_tokens: 0,
        };
        let t = translate_in(&store, json!({"input": "hi", "background": true})).unwrap();
        let mut responder = ResponsesResponder::new(&plan(false), t.template, tokenizer(), t.kept);
        let (accepted, _background) = responder.accept_background().unwrap().unwrap();
        responder.collect_event(finished(output()));
        let answer = responder.collect_event(Event::Done).unwrap().unwrap();
        assert_eq!(answer.status, "failed");
        let kept = store.get(&accepted.id).unwrap();
        assert_eq!(kept.response.status, "failed");
        assert!(kept.response.output.is_empty());
        // Streamed, its live stream ends with the same failure.
        let t = translate_in(&store, json!({"input": "hi", "background": true, "stream": true})).unwrap();
        let mut responder = ResponsesResponder::new(&plan(false), t.template, tokenizer(), t.kept);
        let (accepted, _background) = responder.accept_background().unwrap().unwrap();
        // A stream's output is its deltas.
        let mut streamed = output();
        streamed.deltas = vec![Delta::Content(std::mem::take(&mut streamed.content))];
        responder.stream_event(finished(streamed));
        let (lines, done) = responder.stream_event(Event::Done);
        assert!(done);
        let last = parse(lines.last().unwrap());
        assert_eq!(last["type"], "response.failed");
        assert_eq!(last["response"]["status"], "failed");
        assert_eq!(store.get(&accepted.id).unwrap().response.status, "failed");
        // Too large to accept at all: refused.
        let tiny = Arc::new(ResponseStore::new(64));
        let t = translate_in(&tiny, json!({"input": "hi", "background": true})).unwrap();
        let mut responder = ResponsesResponder::new(&plan(false), t.template, tokenizer(), t.kept);
        let error = responder.accept_background().unwrap().err().unwrap();
        assert_eq!(error.param.as_deref(), Some("background"));
        // A response that is not in the background and finds no room says it was not stored.
        let t = translate_in(&tiny, json!({"input": "hi"})).unwrap();
        assert!(t.template.store);
        let mut responder = ResponsesResponder::new(&plan(false), t.template, tokenizer(), t.kept);
        let mut response = None;
        for event in events() {
            response = response.or(responder.collect_event(event));
        }
        assert!(!response.unwrap().unwrap().store);
    }

    #[tokio::test]
    async fn a_cancel_reaches_the_running_task_and_waits_for_its_end() {
        let store = Arc::new(ResponseStore::new(1 << 20));
        let wait = std::time::Duration::from_secs(5);
        assert!(!store.cancel_background("resp_none", wait).await);
        let background = store.start_background("resp_1", false);
        let task = tokio::spawn(async move {
            background.cancel.notified().await;
            drop(background);
        });
        assert!(store.cancel_background("resp_1", wait).await);
        task.await.unwrap();
        // Ended: no longer running.
        assert!(!store.cancel_background("resp_1", wait).await);
    }

    #[test]
    fn a_continued_response_reads_as_the_whole_conversation_sent_again() {
        for stream in [false, true] {
            let store = Arc::new(ResponseStore::new(1 << 20));
            let first = answer_in(
                &store,
                json!({"input": "Weather?", "instructions": "Be brief."}),
                stream,
            );
            assert_eq!(first["store"], true);
            let id = first["id"].as_str().unwrap();
            let stored = store.get(id).expect("kept before the answer went out");
            assert_eq!(stored.input.len(), 1);
            assert!(stored.input[0]["id"].as_str().unwrap().starts_with("msg_"));
            let output = first["output"].clone();
            let follow = [json!({"type": "function_call_output", "call_id": "call_1", "output": "sunny"})];
            let continued = translate_in(
                &store,
                json!({"input": follow, "previous_response_id": id, "instructions": "Be kind."}),
            )
            .unwrap();
            assert_eq!(continued.template.previous_response_id.as_deref(), Some(id));
            // The same conversation sent whole: the first input, the first output, the new input; the earlier
            // instructions are not carried over.
            let mut whole = vec![json!({"role": "user", "content": "Weather?"})];
            whole.extend(output.as_array().unwrap().iter().cloned());
            whole.extend(follow.iter().cloned());
            let sent = translate_json(json!({"input": whole, "instructions": "Be kind."})).unwrap();
            assert_eq!(continued.chat.messages, sent.chat.messages, "stream: {stream}");
            let roles: Vec<Json> = sent.chat.messages.unwrap().iter().map(|m| m["role"].clone()).collect();
            assert_eq!(roles, ["system", "user", "assistant", "tool"]);
            // The continuation is kept too, and lists every input item that led to it.
            let keep = continued.kept.response.expect("kept");
            let second = StoredResponse::new(continued.template, keep.input, keep.previous);
            let types = |items: &[Json]| -> Vec<Json> { items.iter().map(|i| i["type"].clone()).collect() };
            let mut expected = vec![json!("message")];
            expected.extend(types(output.as_array().unwrap()));
            expected.push(json!("function_call_output"));
            assert_eq!(types(&second.input_items()), expected);
            assert_eq!(second.input_items()[1], output[0]);
        }
    }

    #[test]
    fn input_items_come_in_pages() {
        let items: Vec<Json> = (0..5).map(|i| json!({"id": format!("i{i}")})).collect();
        let page = |query: Json| {
            let query: InputItemsQuery = serde_json::from_value(query).unwrap();
            items_page(&items, &query).map(|page| {
                let ids: Vec<String> = page
                    .data
                    .iter()
                    .map(|i| i["id"].as_str().unwrap().to_string())
                    .collect();
                (ids.join(","), page.has_more, page.first_id, page.last_id)
            })
        };
        let (ids, more, first, last) = page(json!({})).unwrap();
        assert_eq!((ids.as_str(), more), ("i4,i3,i2,i1,i0", false));
        assert_eq!((first.as_deref(), last.as_deref()), (Some("i4"), Some("i0")));
        assert_eq!(page(json!({"order": "asc", "limit": 2})).unwrap().0, "i0,i1");
        assert!(page(json!({"order": "asc", "limit": 2})).unwrap().1);
        let (ids, more, ..) = page(json!({"order": "asc", "limit": 2, "after": "i3"})).unwrap();
        assert_eq!((ids.as_str(), more), ("i4", false));
        assert_eq!(page(json!({"limit": 2, "after": "i4"})).unwrap().0, "i3,i2");
        assert_eq!(page(json!({"order": "asc", "before": "i2"})).unwrap().0, "i0,i1");
        // A page before a cursor is the one next to it.
        let (ids, more, ..) = page(json!({"order": "asc", "before": "i3", "limit": 2})).unwrap();
        assert_eq!((ids.as_str(), more), ("i1,i2", true));
        assert_eq!(
            page(json!({"order": "asc", "after": "i3", "before": "i1"})).unwrap().0,
            ""
        );
        for (query, param) in [
            (json!({"limit": 0}), "limit"),
            (json!({"limit": 101}), "limit"),
            (json!({"order": "up"}), "order"),
            (json!({"after": "nope"}), "after"),
            (json!({"before": "nope"}), "before"),
        ] {
            let error = page(query.clone())
                .err()
                .unwrap_or_else(|| panic!("{query} was accepted"));
            assert_eq!(error.param.as_deref(), Some(param));
        }
    }

    #[test]
    fn unknown_and_unkept_responses_cannot_be_continued() {
        let store = Arc::new(ResponseStore::new(1 << 20));
        let unkept = answer_in(&store, json!({"input": "hi", "store": false}), false);
        assert_eq!(unkept["store"], false);
        for id in [unkept["id"].as_str().unwrap(), "resp_unknown"] {
            let error = translate_in(&store, json!({"input": "more", "previous_response_id": id}))
                .err()
                .expect("refused");
            assert_eq!(error.status.as_u16(), 400);
            assert_eq!(error.param.as_deref(), Some("previous_response_id"));
            assert_eq!(error.code, Some("previous_response_not_found"));
        }
        // With the store off, nothing is kept and responses say so.
        let off = Arc::new(ResponseStore::new(0));
        let response = answer_in(&off, json!({"input": "hi"}), true);
        assert_eq!(response["store"], false);
        assert_eq!(off.usage(), (0, 0));
    }

    #[test]
    fn input_items_become_chat_messages() {
        let t = translate_json(json!({
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "Weather in "}, {"type": "input_text", "text": "Paris?"}]},
                {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "Call the tool."}]},
                {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{\"city\":\"Paris\"}"},
                {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": "{\"city\":\"Lyon\"}"},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]},
            ],
            "tools": [{"type": "function", "name": "weather", "parameters": {"type": "object"}}],
            "tool_choice": {"type": "function", "name": "weather"},
            "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}},
            "max_output_tokens": 7,
            "reasoning": {"effort": "low"},
        }))
        .unwrap();
        let messages = t.chat.messages.unwrap();
        assert_eq!(messages[0], json!({"role": "system", "content": "Be brief."}));
        assert_eq!(messages[1], json!({"role": "user", "content": "Weather in Paris?"}));
        assert_eq!(messages[2]["reasoning_content"], "Call the tool.");
        assert_eq!(messages[2]["tool_calls"].as_array().unwrap().len(), 2);
        assert_eq!(messages[2]["tool_calls"][1]["id"], "c2");
        assert_eq!(
            messages[3],
            json!({"role": "tool", "tool_call_id": "c1", "content": "sunny"})
        );
        assert_eq!(messages[4], json!({"role": "assistant", "content": "Sunny."}));
        assert_eq!(messages.len(), 5);
        assert_eq!(
            t.chat.tools.unwrap()[0],
            json!({"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}})
        );
        assert_eq!(
            t.chat.tool_choice.unwrap(),
            json!({"type": "function", "function": {"name": "weather"}})
        );
        assert_eq!(
            t.chat.response_format.unwrap(),
            json!({"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}})
        );
        assert_eq!(t.chat.max_completion_tokens, Some(7));
        assert_eq!(t.chat.reasoning_effort.as_deref(), Some("low"));
        assert_eq!(t.template.status, "in_progress");
        assert!(t.template.id.starts_with("resp_"));
    }

    #[test]
    fn an_assistant_turn_sent_back_is_one_message() {
        let call = |id: &str| json!({"type": "function_call", "call_id": id, "name": "f", "arguments": "{}"});
        let t = translate_json(json!({"input": [
            {"role": "user", "content": "Weather?"},
            // A response's output as it comes back: reasoning, message, calls.
            {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "Look it up."}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
            call("c1"),
            call("c2"),
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"type": "function_call_output", "call_id": "c2", "output": "rain"},
            // A streamed turn whose held-back text came after its call, and encrypted reasoning without text.
            {"type": "reasoning", "summary": [], "encrypted_content": "x"},
            call("c3"),
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": " "}]},
            {"type": "function_call_output", "call_id": "c3", "output": "fog"},
            {"role": "user", "content": "Thanks."},
        ]}))
        .unwrap();
        let messages = t.chat.messages.unwrap();
        let roles: Vec<&str> = messages.iter().map(|m| m["role"].as_str().unwrap()).collect();
        assert_eq!(
            roles,
            ["user", "assistant", "tool", "tool", "assistant", "tool", "user"]
        );
        assert_eq!(messages[1]["content"], "Let me look.");
        assert_eq!(messages[1]["reasoning_content"], "Look it up.");
        assert_eq!(messages[1]["tool_calls"].as_array().unwrap().len(), 2);
        assert_eq!(messages[4]["content"], " ");
        assert_eq!(messages[4]["tool_calls"][0]["id"], "c3");
        assert!(messages[4].get("reasoning_content").is_none());
    }

    #[test]
    fn a_failed_stream_ends_with_response_failed() {
        let mut responder = responder();
        let (first, _) = responder.stream_event(token(vec![Delta::Content("Hi".into())]));
        let (last, done) = responder.stream_event(Event::Error(ApiError::engine_failed()));
        assert!(done);
        let events: Vec<Json> = first.iter().chain(&last).map(parse).collect();
        let kinds: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
        assert_eq!(
            kinds[kinds.len() - 3..],
            ["response.output_item.done", "error", "response.failed"]
        );
        let failed = &events.last().unwrap()["response"];
        assert_eq!(failed["status"], "failed");
        assert_eq!(failed["error"]["code"], "engine_failed");
        assert!(failed["usage"].is_null());
        assert_eq!(outline(failed), [("message".to_string(), "Hi".to_string())]);
    }

    #[test]
    fn stateful_and_unsupported_fields_are_refused_by_name() {
        for (body, param) in [
            (
                json!({"input": "hi", "previous_response_id": "resp_1"}),
                "previous_response_id",
            ),
            (
                json!({"input": "hi", "conversation": "conv_1", "previous_response_id": "resp_1"}),
                "conversation",
            ),
            (json!({"input": "hi", "conversation": 3}), "conversation"),
            (json!({"input": "hi", "background": true, "store": false}), "background"),
            (json!({"input": "hi", "truncation": "sometimes"}), "truncation"),
            (json!({"input": "hi", "prompt": {"id": "pmpt_1"}}), "prompt"),
            (
                json!({"input": "hi", "tools": [{"type": "custom", "name": "patch"}]}),
                "tools[0]",
            ),
            (
                json!({"input": "hi", "include": ["file_search_call.results"]}),
                "include",
            ),
            (json!({"input": "hi", "top_logprobs": 21}), "top_logprobs"),
            (json!({"input": "hi", "n": 2}), "n"),
            (json!({"input": [{"type": "input_image"}]}), "input[0].type"),
            (
                json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}),
                "input[0].content[0]",
            ),
            (
                json!({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}),
                "input[0].call_id",
            ),
            (json!({"input": 3}), "input"),
            (json!({}), "input"),
            (
                json!({"input": "hi", "text": {"format": {"type": "xml"}}}),
                "text.format",
            ),
        ] {
            let error = translate_json(body.clone())
                .err()
                .unwrap_or_else(|| panic!("{body} was accepted"));
            assert_eq!(error.status.as_u16(), 400, "{body}");
            assert_eq!(error.param.as_deref(), Some(param), "{body}: {}", error.message);
        }
        // What the client may send and lily has no use for is accepted.
        let t = translate_json(json!({
            "input": "hi", "store": false, "include": ["reasoning.encrypted_content"], "metadata": {"k": "v"},
            "truncation": "auto", "tool_choice": "auto", "tools": [{"type": "web_search", "external_web_access": false}],
        }))
        .unwrap();
        assert!(!t.template.store);
        assert_eq!(t.template.metadata, json!({"k": "v"}));
        // The hosted tool is left out, and with it the tool choice that chat only allows beside tools.
        assert!(t.chat.tools.is_none() && t.chat.tool_choice.is_none());
    }

    fn token(deltas: Vec<Delta>) -> Event {
        Event::Token {
            index: 0,
            deltas,
            logprob: None,
        }
    }

    /// A generation that thinks, answers and calls a tool, as the engine reports it.
    fn events() -> Vec<Event> {
        let call = |id: Option<&str>, arguments: &str| {
            Delta::ToolCall(lily_chat::ToolCallDelta {
                index: 0,
                id: id.map(String::from),
                name: id.map(|_| "f".to_string()),
                arguments: arguments.into(),
            })
        };
        let output = FinalOutput {
            deltas: vec![Delta::Content("!".into())],
            reasoning: "think more".into(),
            content: "Hi!".into(),
            content_is_reasoning: false,
            tool_calls: vec![lily_chat::ToolCall {
                id: "call_1".into(),
                name: "f".into(),
                arguments: "{\"a\":1}".into(),
            }],
            finish_reason: FinishReason::ToolCalls,
            completion_tokens: 9,
            reasoning_tokens: 4,
        };
        vec![
            token(vec![Delta::Reasoning("think ".into())]),
            token(vec![Delta::Reasoning("more".into()), Delta::Content("Hi".into())]),
            token(vec![call(Some("call_1"), "")]),
            token(vec![call(None, "{\"a\":1}")]),
            Event::Finished {
                index: 0,
                output,
                cached_tokens: 2,
            },
            Event::Done,
        ]
    }

    /// A streamed event's JSON, checked to carry its type as the SSE event name.
    fn parse(event: &SseData) -> Json {
        let json: Json = serde_json::from_str(&event.data).unwrap();
        assert_eq!(event.event, json["type"].as_str(), "the event name is the type");
        json
    }

    fn responder() -> ResponsesResponder {
        responder_with(false)
    }

    /// The bundled model's tokenizer, loaded once.
    fn tokenizer() -> Arc<Tokenizer> {
        static TOKENIZER: std::sync::OnceLock<Arc<Tokenizer>> = std::sync::OnceLock::new();
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/lily-tiny-shakespeare");
        TOKENIZER
            .get_or_init(|| Arc::new(Tokenizer::from_dir(&dir).unwrap()))
            .clone()
    }

    fn plan(logprobs: bool) -> ChatPlan {
        ChatPlan {
            stream: true,
            include_usage: false,
            logprobs,
            parallel_tool_calls: true,
            prompt_tokens: 5,
            sequences: Vec::new(),
        }
    }

    fn responder_with(logprobs: bool) -> ResponsesResponder {
        let template = translate_json(json!({"input": "hi"})).unwrap().template;
        ResponsesResponder::new(
            &plan(logprobs),
            template,
            tokenizer(),
            Kept {
                response: None,
                conversation: None,
            },
        )
    }

    /// A token event with the logprob of token `id` (and one alternative).
    fn token_with_logprob(id: u32, deltas: Vec<Delta>) -> Event {
        Event::Token {
            index: 0,
            deltas,
            logprob: Some(crate::logits::TokenLogprob {
                token: id,
                logprob: -(id as f32) / 1000.0,
                top: vec![(id, -(id as f32) / 1000.0)],
            }),
        }
    }

    /// `include: ["message.output_text.logprobs"]` and `top_logprobs` ask the chat request for logprobs; the
    /// message's text carries its tokens' logprobs (a token whose text was held back goes with the text that
    /// follows), streamed and whole, and the reasoning's tokens carry none.
    #[test]
    fn the_message_text_carries_its_tokens_logprobs() {
        let t = translate_json(json!({"input": "hi", "include": ["message.output_text.logprobs"]})).unwrap();
        assert_eq!((t.chat.logprobs, t.chat.top_logprobs), (Some(true), Some(0)));
        let t = translate_json(json!({"input": "hi", "top_logprobs": 3})).unwrap();
        assert_eq!((t.chat.logprobs, t.chat.top_logprobs), (Some(true), Some(3)));
        let t = translate_json(json!({"input": "hi"})).unwrap();
        assert_eq!((t.chat.logprobs, t.chat.top_logprobs), (None, None));

        let finished = || Event::Finished {
            index: 0,
            output: FinalOutput {
                deltas: vec![],
                reasoning: "think".into(),
                content: "Hi there".into(),
                content_is_reasoning: false,
                tool_calls: vec![],
                finish_reason: FinishReason::Stop,
                completion_tokens: 4,
                reasoning_tokens: 1,
            },
            cached_tokens: 0,
        };
        let events = || {
            vec![
                token_with_logprob(10, vec![Delta::Reasoning("think".into())]),
                token_with_logprob(11, vec![]),
                token_with_logprob(12, vec![Delta::Content("Hi".into())]),
                token_with_logprob(13, vec![Delta::Content(" there".into())]),
                finished(),
                Event::Done,
            ]
        };
        let ids = |logprobs: &Json| -> Vec<f64> {
            (logprobs.as_array().unwrap().iter())
                .map(|e| -e["logprob"].as_f64().unwrap() * 1000.0)
                .map(f64::round)
                .collect()
        };
        // Streamed: each text delta with its tokens' logprobs; the done events and the item with all of them.
        let mut responder = responder_with(true);
        let lines: Vec<Json> = events()
            .into_iter()
            .flat_map(|e| responder.stream_event(e).0)
            .map(|l| parse(&l))
            .collect();
        let deltas: Vec<Vec<f64>> = (lines.iter())
            .filter(|e| e["type"] == "response.output_text.delta")
            .map(|e| ids(&e["logprobs"]))
            .collect();
        assert_eq!(deltas, [vec![11.0, 12.0], vec![13.0]]);
        let done = lines.iter().find(|e| e["type"] == "response.output_text.done").unwrap();
        assert_eq!(ids(&done["logprobs"]), [11.0, 12.0, 13.0]);
        let last = &lines.last().unwrap()["response"]["output"];
        assert_eq!(ids(&last[1]["content"][0]["logprobs"]), [11.0, 12.0, 13.0]);
        let entry = &done["logprobs"][0];
        assert_eq!(entry["top_logprobs"].as_array().unwrap().len(), 1);
        assert!(entry["token"].is_string() && entry["bytes"].is_array());
        // Whole: the same on the message's text; none where not asked for.
        let whole = |logprobs: bool| {
            let mut responder = responder_with(logprobs);
            let response = events().into_iter().find_map(|e| responder.collect_event(e));
            let response = serde_json::to_value(response.unwrap().unwrap()).unwrap();
            response["output"][1]["content"][0]["logprobs"].clone()
        };
        assert_eq!(ids(&whole(true)), [11.0, 12.0, 13.0]);
        assert_eq!(whole(false), json!([]));
    }

    /// The item kinds and texts of a response's output.
    fn outline(response: &Json) -> Vec<(String, String)> {
        let items = response["output"].as_array().unwrap();
        let text = |item: &Json| match item["type"].as_str().unwrap() {
            "function_call" => format!(
                "{}({})",
                item["name"].as_str().unwrap(),
                item["arguments"].as_str().unwrap()
            ),
            _ => item["content"][0]["text"].as_str().unwrap().to_string(),
        };
        items
            .iter()
            .map(|item| (item["type"].as_str().unwrap().to_string(), text(item)))
            .collect()
    }

    #[test]
    fn a_stream_opens_and_closes_each_item_in_order() {
        let mut responder = responder();
        let mut lines = Vec::new();
        let mut ended = false;
        for event in events() {
            assert!(!ended, "events after the end");
            let (data, done) = responder.stream_event(event);
            lines.extend(data);
            ended = done;
        }
        assert!(ended);
        let events: Vec<Json> = lines.iter().map(parse).collect();
        let kinds: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
        assert_eq!(
            kinds,
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.reasoning_text.delta",
                "response.reasoning_text.delta",
                "response.reasoning_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                // The held-back "!" comes with the finish, after the call: a message of its own.
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        for (i, event) in events.iter().enumerate() {
            assert_eq!(event["sequence_number"], i as u64);
        }
        let final_response = &events.last().unwrap()["response"];
        assert_eq!(final_response["status"], "completed");
        assert_eq!(
            outline(final_response),
            [
                ("reasoning".to_string(), "think more".to_string()),
                ("message".into(), "Hi".into()),
                ("function_call".into(), "f({\"a\":1})".into()),
                ("message".into(), "!".into()),
            ]
        );
        assert_eq!(final_response["usage"]["input_tokens"], 5);
        assert_eq!(final_response["usage"]["output_tokens"], 9);
        assert_eq!(final_response["usage"]["input_tokens_details"]["cached_tokens"], 2);
        assert_eq!(final_response["usage"]["output_tokens_details"]["reasoning_tokens"], 4);
        assert_eq!(final_response["usage"]["total_tokens"], 14);
        // Each delta event names the item that the `added` event before it opened.
        let mut open = String::new();
        for event in &events {
            match event["type"].as_str().unwrap() {
                "response.output_item.added" => open = event["item"]["id"].as_str().unwrap().to_string(),
                kind if kind.ends_with(".delta") => assert_eq!(event["item_id"].as_str().unwrap(), open),
                _ => {}
            }
        }
    }

    #[test]
    fn a_whole_response_has_the_finished_output() {
        let mut responder = responder();
        let mut response = None;
        for event in events() {
            if let Some(result) = responder.collect_event(event) {
                response = Some(serde_json::to_value(result.unwrap()).unwrap());
            }
        }
        let response = response.expect("a response at Done");
        assert_eq!(response["status"], "completed");
        assert_eq!(
            outline(&response),
            [
                ("reasoning".to_string(), "think more".to_string()),
                ("message".into(), "Hi!".into()),
                ("function_call".into(), "f({\"a\":1})".into()),
            ]
        );
        assert_eq!(response["output"][2]["call_id"], "call_1");
    }

    #[test]
    fn a_response_cut_by_max_output_tokens_is_incomplete() {
        let mut responder = self::responder();
        let output = FinalOutput {
            deltas: Vec::new(),
            reasoning: String::new(),
            content: "Hi".into(),
            content_is_reasoning: false,
            tool_calls: Vec::new(),
            finish_reason: FinishReason::Length,
            completion_tokens: 1,
            reasoning_tokens: 0,
        };
        let streamed_finish = Event::Finished {
            index: 0,
            output: output.clone(),
            cached_tokens: 0,
        };
        let finished = Event::Finished {
            index: 0,
            output,
            cached_tokens: 0,
        };
        assert!(responder.collect_event(finished).is_none());
        let response = serde_json::to_value(responder.collect_event(Event::Done).unwrap().unwrap()).unwrap();
        assert_eq!(response["status"], "incomplete");
        assert_eq!(response["incomplete_details"]["reason"], "max_output_tokens");
        assert_eq!(response["output"][0]["status"], "incomplete");
        assert_eq!(responder.take_reply().as_deref(), Some("Hi"));
        // Streamed, the item that the limit cut ends `incomplete` too.
        let mut responder = self::responder();
        responder.stream_event(token(vec![Delta::Content("Hi".into())]));
        let (lines, _) = responder.stream_event(streamed_finish);
        let done: Vec<Json> = lines.iter().map(parse).collect();
        let item = done.iter().find(|e| e["type"] == "response.output_item.done").unwrap();
        assert_eq!(item["item"]["status"], "incomplete");
    }

    #[test]
    fn chat_params_in_errors_are_renamed() {
        let e = responses_param(ApiError::invalid("messages[2].content", "x"));
        assert_eq!(e.param.as_deref(), Some("input"));
        let e = responses_param(ApiError::invalid("max_completion_tokens", "x"));
        assert_eq!(e.param.as_deref(), Some("max_output_tokens"));
        let e = responses_param(ApiError::invalid("temperature", "x"));
        assert_eq!(e.param.as_deref(), Some("temperature"));
    }
}
