//! The model's chat template, rendered with minijinja the way Hugging Face's `apply_chat_template` renders it
//! with Jinja2: trim_blocks and lstrip_blocks on, `raise_exception`, a `tojson` that is Python's `json.dumps`,
//! Python string methods, and values printed as Python prints them.

use std::path::{Path, PathBuf};

use minijinja::value::{from_args, Kwargs, Rest, Value};
use minijinja::{Environment, ErrorKind};
use serde_json::{Map, Value as Json};

use crate::python_format::{json_dumps, python_str, JsonDumpsOptions};

const TEMPLATE_NAME: &str = "chat_template";

/// The special-token variables HF passes to every template (`tokenizer.special_tokens_map`).
const SPECIAL_TOKEN_VARIABLES: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// The names a message's reasoning arrives under; HF copies the first one present to `reasoning_content`
/// (which templates read) and to `thinking`.
const REASONING_FIELDS: [&str; 3] = ["reasoning_content", "thinking", "reasoning"];

#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error("no chat template in {0}: expected chat_template.jinja or a chat_template field in tokenizer_config.json")]
    NotFound(PathBuf),
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("cannot use {path}: {message}")]
    BadTokenizerConfig { path: PathBuf, message: String },
    #[error("the chat template does not compile: {0}")]
    Syntax(String),
    /// The template called `raise_exception(message)`; `message` is exactly the template's text.
    #[error("the chat template rejected the conversation: {message}")]
    Raised { message: String },
    #[error("the chat template failed: {0}")]
    Render(String),
    #[error("message {index} is not a JSON object")]
    MessageNotObject { index: usize },
    #[error("message {index}: content parts of type {part_type:?} are not supported; only text parts are")]
    UnsupportedContentPart { index: usize, part_type: String },
    #[error("message {index}: a text content part has no string \"text\" field")]
    BadTextPart { index: usize },
    #[error("message {index}: tool call arguments are not a JSON object: {reason}")]
    BadToolCallArguments { index: usize, reason: String },
}

/// One rendering of a conversation, as the OpenAI chat API delivers it.
#[derive(Debug, Clone, Default)]
pub struct RenderRequest {
    /// OpenAI-style messages: `{"role", "content", "reasoning_content"?, "tool_calls"?, ...}`.
    pub messages: Vec<Json>,
    /// Tool definitions as given by the client (`{"type": "function", "function": {...}}`).
    pub tools: Option<Vec<Json>>,
    pub add_generation_prompt: bool,
    /// Extra template variables, e.g. `enable_thinking`, `preserve_thinking`.
    pub kwargs: Map<String, Json>,
}

#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    special_tokens: Map<String, Json>,
}

/// Marks an error as coming from the template's own `raise_exception`, so it can be told from engine failures.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct RaisedByTemplate(String);

impl ChatTemplate {
    /// Loads the template of a model directory: `chat_template.jinja`, else the `chat_template` field of
    /// `tokenizer_config.json` (a string, or a list of `{name, template}` from which "default" is taken).
    /// Special tokens named in `tokenizer_config.json` become template variables as in HF.
    pub fn from_dir(model_dir: &Path) -> Result<Self, TemplateError> {
        let config_path = model_dir.join("tokenizer_config.json");
        let config = if config_path.is_file() {
            Some(read_json_object(&config_path)?)
        } else {
            None
        };

        let jinja_path = model_dir.join("chat_template.jinja");
        let source = if jinja_path.is_file() {
            std::fs::read_to_string(&jinja_path).map_err(|source| TemplateError::Read {
                path: jinja_path,
                source,
            })?
        } else {
            let bad_config = |message: &str| TemplateError::BadTokenizerConfig {
                path: config_path.clone(),
                message: message.to_string(),
            };
            match config.as_ref().and_then(|config| config.get("chat_template")) {
                None | Some(Json::Null) => return Err(TemplateError::NotFound(model_dir.to_path_buf())),
                Some(Json::String(source)) => source.clone(),
                Some(Json::Array(named)) => named
                    .iter()
                    .find(|entry| entry.get("name").and_then(Json::as_str) == Some("default"))
                    .and_then(|entry| entry.get("template"))
                    .and_then(Json::as_str)
                    .ok_or_else(|| bad_config("chat_template is a list without a \"default\" template"))?
                    .to_string(),
                Some(_) => return Err(bad_config("chat_template is neither a string nor a list of templates")),
            }
        };

        let mut template = Self::from_source(source)?;
        if let Some(config) = &config {
            template.special_tokens = special_tokens_from_config(config);
        }
        Ok(template)
    }

    /// Compiles a template from its source text. No special-token variables are set.
    pub fn from_source(source: String) -> Result<Self, TemplateError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(|out, _state, value| {
            out.write_str(&python_str(value))?;
            Ok(())
        });
        env.add_filter("tojson", tojson_filter);
        env.add_filter("string", string_filter);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned(TEMPLATE_NAME, source)
            .map_err(|error| TemplateError::Syntax(error.to_string()))?;
        Ok(Self {
            env,
            special_tokens: Map::new(),
        })
    }

    /// The special-token variables (`eos_token`, ...) passed to the template.
    pub fn special_tokens(&self) -> &Map<String, Json> {
        &self.special_tokens
    }

    /// Renders a conversation to the prompt text. The messages are prepared as HF prepares them (keys whose value
    /// is null dropped, `reasoning`/`thinking` aliased to `reasoning_content`), and beyond that: content given as
    /// a list of text parts is joined into one string, other parts are refused, and tool-call arguments given as
    /// a JSON string (as OpenAI clients send them) are decoded into an object.
    pub fn render(&self, request: &RenderRequest) -> Result<String, TemplateError> {
        let messages = request
            .messages
            .iter()
            .enumerate()
            .map(|(index, message)| prepare_message(index, message))
            .collect::<Result<Vec<_>, _>>()?;

        let mut context = self.special_tokens.clone();
        context.extend(request.kwargs.iter().map(|(key, value)| (key.clone(), value.clone())));
        context.insert("messages".into(), Json::Array(messages));
        context.insert("tools".into(), request.tools.clone().map_or(Json::Null, Json::Array));
        context.insert("documents".into(), Json::Null);
        context.insert(
            "add_generation_prompt".into(),
            Json::Bool(request.add_generation_prompt),
        );

        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|error| TemplateError::Render(error.to_string()))?;
        template
            .render(Value::from_serialize(&context))
            .map_err(|error| match raised_message(&error) {
                Some(message) => TemplateError::Raised { message },
                None => TemplateError::Render(error.to_string()),
            })
    }
}

fn read_json_object(path: &Path) -> Result<Map<String, Json>, TemplateError> {
    let text = std::fs::read_to_string(path).map_err(|source| TemplateError::Read {
        path: path.into(),
        source,
    })?;
    match serde_json::from_str(&text) {
        Ok(Json::Object(map)) => Ok(map),
        Ok(_) => Err(TemplateError::BadTokenizerConfig {
            path: path.into(),
            message: "not a JSON object".into(),
        }),
        Err(error) => Err(TemplateError::BadTokenizerConfig {
            path: path.into(),
            message: error.to_string(),
        }),
    }
}

/// Special tokens in tokenizer_config.json are strings or serialized AddedTokens (`{"content": ...}`).
fn special_tokens_from_config(config: &Map<String, Json>) -> Map<String, Json> {
    SPECIAL_TOKEN_VARIABLES
        .iter()
        .filter_map(|name| {
            let token = match config.get(*name)? {
                Json::String(token) => token.clone(),
                Json::Object(added) => added.get("content")?.as_str()?.to_string(),
                _ => return None,
            };
            Some((name.to_string(), Json::String(token)))
        })
        .collect()
}

fn prepare_message(index: usize, message: &Json) -> Result<Json, TemplateError> {
    let Json::Object(fields) = message else {
        return Err(TemplateError::MessageNotObject { index });
    };
    let mut prepared = Map::new();
    for (key, value) in fields {
        if value.is_null() {
            continue;
        }
        let value = match key.as_str() {
            "content" => flatten_text_parts(index, value)?,
            "tool_calls" => decode_tool_call_arguments(index, value)?,
            _ => value.clone(),
        };
        prepared.insert(key.clone(), value);
    }
    Ok(Json::Object(alias_reasoning(prepared)))
}

fn flatten_text_parts(index: usize, content: &Json) -> Result<Json, TemplateError> {
    let Json::Array(parts) = content else {
        return Ok(content.clone());
    };
    let mut text = String::new();
    for part in parts {
        let part_type = part.get("type").and_then(Json::as_str);
        match (part_type, part.get("text")) {
            (Some("text") | None, Some(Json::String(part_text))) => text.push_str(part_text),
            (Some("text") | None, _) => return Err(TemplateError::BadTextPart { index }),
            (Some(other), _) => {
                return Err(TemplateError::UnsupportedContentPart {
                    index,
                    part_type: other.to_string(),
                })
            }
        }
    }
    Ok(Json::String(text))
}

fn decode_tool_call_arguments(index: usize, tool_calls: &Json) -> Result<Json, TemplateError> {
    let Json::Array(calls) = tool_calls else {
        return Ok(tool_calls.clone());
    };
    let mut decoded_calls = calls.clone();
    for call in &mut decoded_calls {
        let function = match call.get_mut("function") {
            Some(function) => function,
            None => call,
        };
        let Some(arguments) = function.get_mut("arguments") else {
            continue;
        };
        let Json::String(text) = arguments else {
            continue;
        };
        let decoded = if text.trim().is_empty() {
            Json::Object(Map::new())
        } else {
            serde_json::from_str(text).map_err(|error| TemplateError::BadToolCallArguments {
                index,
                reason: error.to_string(),
            })?
        };
        if !decoded.is_object() {
            let reason = format!("{text:?} decodes to a JSON {}", json_type_name(&decoded));
            return Err(TemplateError::BadToolCallArguments { index, reason });
        }
        *arguments = decoded;
    }
    Ok(Json::Array(decoded_calls))
}

fn json_type_name(value: &Json) -> &'static str {
    match value {
        Json::Null => "null",
        Json::Bool(_) => "boolean",
        Json::Number(_) => "number",
        Json::String(_) => "string",
        Json::Array(_) => "array",
        Json::Object(_) => "object",
    }
}

/// HF's `{"thinking": r, **message, "reasoning_content": r}` with r the first reasoning field present.
fn alias_reasoning(message: Map<String, Json>) -> Map<String, Json> {
    let Some(reasoning) = REASONING_FIELDS.iter().find_map(|field| message.get(*field)).cloned() else {
        return message;
    };
    let mut aliased = Map::new();
    aliased.insert("thinking".into(), reasoning.clone());
    aliased.extend(message);
    aliased.insert("reasoning_content".into(), reasoning);
    aliased
}

fn raised_message(error: &minijinja::Error) -> Option<String> {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(current) = source {
        if let Some(raised) = current.downcast_ref::<RaisedByTemplate>() {
            return Some(raised.0.clone());
        }
        source = current.source();
    }
    None
}

fn raise_exception(message: Value) -> Result<Value, minijinja::Error> {
    let message = python_str(&message);
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message.clone()).with_source(RaisedByTemplate(message)))
}

/// Jinja2's `string` filter is Python's `str()`: `True`, `None`, `1e+16`.
fn string_filter(value: Value) -> Value {
    if value.is_safe() || value.as_str().is_some() {
        value
    } else {
        Value::from(python_str(&value))
    }
}

/// HF's `tojson`: `json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`,
/// with the same positional order as HF's Python function.
fn tojson_filter(value: &Value, args: Rest<Value>) -> Result<Value, minijinja::Error> {
    let (ensure_ascii, indent, separators, sort_keys, kwargs): (
        Option<Value>,
        Option<Value>,
        Option<Value>,
        Option<Value>,
        Kwargs,
    ) = from_args(&args)?;
    let argument = |positional: Option<Value>, name: &str| -> Result<Option<Value>, minijinja::Error> {
        match kwargs.get::<Option<Value>>(name)? {
            Some(value) => Ok(Some(value)),
            None => Ok(positional),
        }
    };
    let ensure_ascii = argument(ensure_ascii, "ensure_ascii")?.is_some_and(|value| value.is_true());
    let indent = argument(indent, "indent")?;
    let separators = argument(separators, "separators")?;
    let sort_keys = argument(sort_keys, "sort_keys")?.is_some_and(|value| value.is_true());
    kwargs.assert_all_used()?;

    let invalid = |message: &str| minijinja::Error::new(ErrorKind::InvalidOperation, message.to_string());
    let indent = match indent {
        None => None,
        Some(value) if value.is_none() || value.is_undefined() => None,
        Some(value) => match (value.as_str(), value.as_i64()) {
            (Some(text), _) => Some(text.to_string()),
            (None, Some(width)) => Some(" ".repeat(width.max(0) as usize)),
            _ => return Err(invalid("tojson: indent must be an integer or a string")),
        },
    };
    let separators = match separators {
        None => None,
        Some(value) if value.is_none() || value.is_undefined() => None,
        Some(value) => {
            let parts: Vec<Value> = value.try_iter()?.collect();
            match parts.as_slice() {
                [item, key] if item.as_str().is_some() && key.as_str().is_some() => {
                    Some((item.to_string(), key.to_string()))
                }
                _ => return Err(invalid("tojson: separators must be a pair of strings")),
            }
        }
    };
    let options = JsonDumpsOptions::new(ensure_ascii, indent, separators, sort_keys);
    json_dumps(value, &options)
        .map(Value::from)
        .map_err(|message| invalid(&format!("tojson: {message}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn render_source(source: &str, context: Json) -> Result<String, minijinja::Error> {
        let template = ChatTemplate::from_source(source.to_string()).unwrap();
        template
            .env
            .get_template(TEMPLATE_NAME)?
            .render(Value::from_serialize(&context))
    }

    #[test]
    fn prints_values_as_python_does() {
        let out = render_source(
            "{{ a }} {{ b }} {{ c }} {{ d }} {{ e|string }} {{ missing }}|",
            json!({
                "a": true, "b": null, "c": 1e16, "d": [1, "x"], "e": false
            }),
        )
        .unwrap();
        assert_eq!(out, "True None 1e+16 [1, 'x'] False |");
    }

    #[test]
    fn tojson_arguments() {
        let context = json!({"x": {"b": [1, 2], "a": "é"}});
        assert_eq!(
            render_source("{{ x|tojson }}", context.clone()).unwrap(),
            r#"{"b": [1, 2], "a": "é"}"#
        );
        assert_eq!(
            render_source("{{ x|tojson(indent=1) }}", context.clone()).unwrap(),
            "{\n \"b\": [\n  1,\n  2\n ],\n \"a\": \"é\"\n}"
        );
        assert_eq!(
            render_source("{{ x|tojson(sort_keys=true, separators=[',', ':']) }}", context.clone()).unwrap(),
            r#"{"a":"é","b":[1,2]}"#
        );
        assert_eq!(
            render_source("{{ x|tojson(true) }}", context.clone()).unwrap(),
            r#"{"b": [1, 2], "a": "\u00e9"}"#
        );
        assert!(render_source("{{ x|tojson(bogus=1) }}", context).is_err());
    }

    #[test]
    fn python_methods_slicing_and_loop_features() {
        let source = "{% for m in items[::-1] %}{{ loop.index0 }}{{ m.strip().upper() }}{% if loop.previtem %}<{{ loop.previtem }}{% endif %}{% if not loop.last %},{% endif %}{% endfor %}|{{ 'a</think>b'.split('</think>')[-1] }}|{{ 'xx\\n'.rstrip('\\n').startswith('x') }}";
        let out = render_source(source, json!({"items": [" a ", "b"]})).unwrap();
        assert_eq!(out, "0B,1A<b|b|True");
        let loop_controls = "{% for x in [1, 2, 3, 4] %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 4 %}{% break %}{% endif %}{{ x }}{% endfor %}";
        assert_eq!(render_source(loop_controls, json!({})).unwrap(), "13");
    }

    #[test]
    fn raise_exception_message_is_kept() {
        let template = ChatTemplate::from_source(
            "{% macro check(x) %}{% if x %}{{ raise_exception('Bad ' ~ x) }}{% endif %}{% endmacro %}{{ check(messages[0].role) }}".into(),
        )
        .unwrap();
        let request = RenderRequest {
            messages: vec![json!({"role": "robot"})],
            ..Default::default()
        };
        match template.render(&request) {
            Err(TemplateError::Raised { message }) => assert_eq!(message, "Bad robot"),
            other => panic!("expected a raised error, got {other:?}"),
        }
    }

    #[test]
    fn syntax_errors_are_reported() {
        let error = ChatTemplate::from_source("{% if %}".into()).unwrap_err();
        assert!(matches!(error, TemplateError::Syntax(_)), "{error}");
    }

    #[test]
    fn messages_are_prepared_as_hf_and_openai_clients_expect() {
        let message = json!({
            "role": "assistant",
            "content": [{"type": "text", "text": "a"}, {"text": "b"}],
            "name": null,
            "reasoning": "why",
            "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}},
                {"name": "g", "arguments": ""}
            ]
        });
        let prepared = prepare_message(0, &message).unwrap();
        assert_eq!(
            prepared,
            json!({
                "thinking": "why",
                "role": "assistant",
                "content": "ab",
                "reasoning": "why",
                "tool_calls": [
                    {"id": "1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}},
                    {"name": "g", "arguments": {}}
                ],
                "reasoning_content": "why"
            })
        );
        let keys: Vec<&String> = prepared.as_object().unwrap().keys().collect();
        assert_eq!(
            keys,
            [
                "thinking",
                "role",
                "content",
                "reasoning",
                "tool_calls",
                "reasoning_content"
            ]
        );
    }

    #[test]
    fn bad_messages_are_refused_clearly() {
        let image = json!({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]});
        let error = prepare_message(2, &image).unwrap_err();
        assert_eq!(
            error.to_string(),
            "message 2: content parts of type \"image_url\" are not supported; only text parts are"
        );
        assert!(matches!(
            prepare_message(0, &json!("hi")),
            Err(TemplateError::MessageNotObject { index: 0 })
        ));
        assert!(matches!(
            prepare_message(0, &json!({"role": "user", "content": [{"type": "text"}]})),
            Err(TemplateError::BadTextPart { index: 0 })
        ));
        let bad_arguments =
            json!({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]});
        assert!(matches!(
            prepare_message(1, &bad_arguments),
            Err(TemplateError::BadToolCallArguments { index: 1, .. })
        ));
        let list_arguments =
            json!({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]});
        let error = prepare_message(1, &list_arguments).unwrap_err();
        assert!(error.to_string().contains("decodes to a JSON array"), "{error}");
    }

    #[test]
    fn loads_from_tokenizer_config() {
        let dir = tempfile::tempdir().unwrap();
        let config = json!({
            "eos_token": {"content": "<|im_end|>", "special": true},
            "pad_token": "<|endoftext|>",
            "bos_token": null,
            "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "{{ eos_token }}{{ bos_token }}"}]
        });
        std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
        let template = ChatTemplate::from_dir(dir.path()).unwrap();
        assert_eq!(template.render(&RenderRequest::default()).unwrap(), "<|im_end|>");

        std::fs::write(dir.path().join("chat_template.jinja"), "{{ pad_token }}").unwrap();
        let template = ChatTemplate::from_dir(dir.path()).unwrap();
        assert_eq!(template.render(&RenderRequest::default()).unwrap(), "<|endoftext|>");
    }

    #[test]
    fn missing_template_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        assert!(matches!(
            ChatTemplate::from_dir(dir.path()),
            Err(TemplateError::NotFound(_))
        ));
        std::fs::write(dir.path().join("tokenizer_config.json"), r#"{"chat_template": 3}"#).unwrap();
        assert!(matches!(
            ChatTemplate::from_dir(dir.path()),
            Err(TemplateError::BadTokenizerConfig { .. })
        ));
    }
}
