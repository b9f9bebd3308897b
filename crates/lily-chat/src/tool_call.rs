//! Tool calls in generated content. Qwen3.5/3.6 write the XML form
//! `<tool_call>\n<function=NAME>\n<parameter=K>\nV\n</parameter>\n</function>\n</tool_call>`;
//! older Qwen models write `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, accepted too.
//! A call is reported once its `</tool_call>` arrives; a malformed or unfinished one is passed on as content.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};

use serde_json::{Map, Value as Json};

use crate::partial_match::partial_suffix_len;

const CALL_START: &str = "<tool_call>";
const CALL_END: &str = "</tool_call>";
const FUNCTION_START: &str = "<function=";
const FUNCTION_END: &str = "</function>";
const PARAMETER_START: &str = "<parameter=";
const PARAMETER_END: &str = "</parameter>";

/// A parsed call, with its arguments as a JSON object in text form (as the OpenAI API carries them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    pub arguments: String,
}

/// How tool-call ids are made: random (`call_` + 24 letters and digits) or `call_0`, `call_1`, ... for tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ToolCallIds {
    #[default]
    Random,
    Sequential,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolCallEvent {
    Content(String),
    Call(ToolCall),
}

/// Parameter types per tool, from the tools' JSON schemas, to turn parameter text into JSON values.
#[derive(Debug, Clone, Default)]
struct ToolSchemas {
    parameter_types: HashMap<String, HashMap<String, Vec<String>>>,
}

impl ToolSchemas {
    /// Reads tools as OpenAI sends them (`{"type": "function", "function": {...}}`) or bare function objects.
    fn new(tools: &[Json]) -> Self {
        let mut parameter_types = HashMap::new();
        for tool in tools {
            let function = tool.get("function").unwrap_or(tool);
            let Some(name) = function.get("name").and_then(Json::as_str) else {
                continue;
            };
            let properties = function.pointer("/parameters/properties").and_then(Json::as_object);
            let types = properties
                .into_iter()
                .flatten()
                .map(|(parameter, schema)| (parameter.clone(), schema_types(schema)))
                .collect();
            parameter_types.insert(name.to_string(), types);
        }
        Self { parameter_types }
    }

    fn types(&self, function: &str, parameter: &str) -> &[String] {
        self.parameter_types
            .get(function)
            .and_then(|types| types.get(parameter))
            .map_or(&[], Vec::as_slice)
    }
}

/// The JSON types a schema allows: `"type"` as a string or list, or the types of `anyOf`/`oneOf` branches. The
/// constrained-decoding grammar for tool calls reads schemas the same way, so grammar and parser agree on which
/// values are text.
pub fn schema_types(schema: &Json) -> Vec<String> {
    match schema.get("type") {
        Some(Json::String(kind)) => return vec![kind.clone()],
        Some(Json::Array(kinds)) => return kinds.iter().filter_map(Json::as_str).map(str::to_string).collect(),
        _ => {}
    }
    ["anyOf", "oneOf"]
        .iter()
        .filter_map(|key| schema.get(*key).and_then(Json::as_array))
        .flatten()
        .flat_map(schema_types)
        .collect()
}

/// Converts a parameter's text to the JSON value its schema asks for; text that does not parse as any allowed
/// non-string type stays a string, as does a parameter without a schema.
fn parameter_value(text: &str, types: &[String]) -> Json {
    let trimmed = text.trim();
    for kind in types {
        let parsed = match kind.as_str() {
            "null" if trimmed == "null" || trimmed == "None" => Some(Json::Null),
            "boolean" => match trimmed.to_ascii_lowercase().as_str() {
                "true" => Some(Json::Bool(true)),
                "false" => Some(Json::Bool(false)),
                _ => None,
            },
            "integer" => trimmed.parse::<i64>().ok().map(Json::from),
            "number" => trimmed.parse::<i64>().ok().map(Json::from).or_else(|| {
                trimmed
                    .parse::<f64>()
                    .ok()
                    .and_then(serde_json::Number::from_f64)
                    .map(Json::Number)
            }),
            "object" => serde_json::from_str::<Json>(trimmed).ok().filter(Json::is_object),
            "array" => serde_json::from_str::<Json>(trimmed).ok().filter(Json::is_array),
            _ => None,
        };
        if let Some(value) = parsed {
            return value;
        }
    }
    Json::String(text.to_string())
}

/// Parses what stands between `<tool_call>` and `</tool_call>`; `None` if it is not a call.
/// `require_end` asks for the closing `</function>` of the XML form (used when `</tool_call>` never came).
fn parse_call_body(body: &str, schemas: &ToolSchemas, require_end: bool) -> Option<(String, Map<String, Json>)> {
    let body = body.trim();
    if body.starts_with('{') {
        parse_json_call(body)
    } else {
        parse_xml_call(body, schemas, require_end)
    }
}

fn parse_json_call(body: &str) -> Option<(String, Map<String, Json>)> {
    let Json::Object(mut call) = serde_json::from_str::<Json>(body).ok()? else {
        return None;
    };
    let Some(Json::String(name)) = call.remove("name") else {
        return None;
    };
    let arguments = match call.remove("arguments").or_else(|| call.remove("parameters")) {
        None | Some(Json::Null) => Map::new(),
        Some(Json::Object(arguments)) => arguments,
        Some(Json::String(text)) => match serde_json::from_str::<Json>(&text).ok()? {
            Json::Object(arguments) => arguments,
            _ => return None,
        },
        Some(_) => return None,
    };
    valid_name(&name).then_some((name, arguments))
}

fn parse_xml_call(body: &str, schemas: &ToolSchemas, require_end: bool) -> Option<(String, Map<String, Json>)> {
    let rest = body.strip_prefix(FUNCTION_START)?;
    let (name, mut rest) = rest.split_once('>')?;
    let name = name.trim();
    if !valid_name(name) {
        return None;
    }
    let mut arguments = Map::new();
    loop {
        rest = rest.trim_start();
        if rest.is_empty() {
            return (!require_end).then(|| (name.to_string(), arguments));
        }
        if let Some(after) = rest.strip_prefix(FUNCTION_END) {
            return after.trim().is_empty().then(|| (name.to_string(), arguments));
        }
        let (parameter, after_key) = rest.strip_prefix(PARAMETER_START)?.split_once('>')?;
        // A parameter missing its `</parameter>` ends where the next parameter or the function's end begins.
        let (value, after_value) = match after_key.find(PARAMETER_END) {
            Some(end) => (&after_key[..end], &after_key[end + PARAMETER_END.len()..]),
            None => {
                let end = [PARAMETER_START, FUNCTION_END]
                    .iter()
                    .filter_map(|tag| after_key.find(tag))
                    .min()
                    .unwrap_or(after_key.len());
                after_key.split_at(end)
            }
        };
        // The template writes `<parameter=K>\n` + value + `\n</parameter>`: those two newlines are layout.
        let value = value.strip_prefix('\n').unwrap_or(value);
        let value = value.strip_suffix('\n').unwrap_or(value);
        let parameter = parameter.trim();
        arguments.insert(
            parameter.to_string(),
            parameter_value(value, schemas.types(name, parameter)),
        );
        rest = after_value;
    }
}

fn valid_name(name: &str) -> bool {
    !name.is_empty() && !name.contains(|ch: char| ch.is_whitespace() || ch == '<' || ch == '>')
}

/// Makes tool-call ids.
#[derive(Debug, Clone)]
struct CallIdMaker {
    kind: ToolCallIds,
    made: usize,
}

impl CallIdMaker {
    fn next_id(&mut self) -> String {
        let id = match self.kind {
            ToolCallIds::Sequential => format!("call_{}", self.made),
            ToolCallIds::Random => format!("call_{}", random_alphanumeric(24)),
        };
        self.made += 1;
        id
    }
}

/// Letters and digits from the standard library's randomly keyed hasher; ids need to be unique, not secret.
fn random_alphanumeric(len: usize) -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    let mut out = String::with_capacity(len);
    let mut bits = 0u64;
    let mut remaining = 0;
    while out.len() < len {
        if remaining == 0 {
            let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
            hasher.write_usize(out.len());
            bits = hasher.finish();
            remaining = 10;
        }
        out.push(ALPHABET[(bits % ALPHABET.len() as u64) as usize] as char);
        bits /= ALPHABET.len() as u64;
        remaining -= 1;
    }
    out
}

/// Streaming tool-call parser over content text.
#[derive(Debug, Clone)]
pub struct ToolCallParser {
    schemas: ToolSchemas,
    ids: CallIdMaker,
    /// Text not yet passed on: a possible `<tool_call>` start or trailing whitespace (dropped if a call follows),
    /// or the body of an open call.
    held_text: String,
    in_call: bool,
    /// Whitespace between the content and an open call: dropped if the call parses, content if it does not.
    whitespace_before_call: String,
    /// Whitespace after a call is layout between calls, not content.
    after_call: bool,
}

impl ToolCallParser {
    /// `tools` are the request's tool definitions; their schemas give the parameter types.
    pub fn new(tools: &[Json], ids: ToolCallIds) -> Self {
        Self {
            schemas: ToolSchemas::new(tools),
            ids: CallIdMaker { kind: ids, made: 0 },
            held_text: String::new(),
            in_call: false,
            whitespace_before_call: String::new(),
            after_call: false,
        }
    }

    pub fn push(&mut self, text: &str) -> Vec<ToolCallEvent> {
        self.held_text.push_str(text);
        let mut events = Vec::new();
        loop {
            if self.in_call {
                let Some(end) = self.held_text.find(CALL_END) else {
                    break;
                };
                let rest = self.held_text.split_off(end + CALL_END.len());
                let block = std::mem::replace(&mut self.held_text, rest);
                let body = &block[..end];
                self.in_call = false;
                match parse_call_body(body, &self.schemas, false) {
                    Some((name, arguments)) => events.push(ToolCallEvent::Call(self.make_call(name, arguments))),
                    None => {
                        let whitespace = std::mem::take(&mut self.whitespace_before_call);
                        self.push_content(&mut events, format!("{whitespace}{CALL_START}{block}"));
                    }
                }
                continue;
            }
            if self.after_call {
                let trimmed = self.held_text.trim_start();
                self.held_text.drain(..self.held_text.len() - trimmed.len());
                if self.held_text.is_empty() {
                    break;
                }
            }
            if let Some(start) = self.held_text.find(CALL_START) {
                let rest = self.held_text.split_off(start + CALL_START.len());
                let mut before = std::mem::replace(&mut self.held_text, rest);
                before.truncate(start);
                let content_len = before.trim_end().len();
                self.whitespace_before_call = before.split_off(content_len);
                self.push_content(&mut events, before);
                self.in_call = true;
                continue;
            }
            let possible_tag = partial_suffix_len(&self.held_text, &[CALL_START]);
            let shown_len = self.held_text[..self.held_text.len() - possible_tag].trim_end().len();
            let held = self.held_text.split_off(shown_len);
            let shown = std::mem::replace(&mut self.held_text, held);
            self.push_content(&mut events, shown);
            break;
        }
        events
    }

    /// End of generation. An open call whose function is complete (`</function>` seen) but whose `</tool_call>`
    /// never came is still a call; anything else held is content.
    pub fn finish(&mut self) -> Vec<ToolCallEvent> {
        let held = std::mem::take(&mut self.held_text);
        let mut events = Vec::new();
        if self.in_call {
            self.in_call = false;
            match parse_call_body(&held, &self.schemas, true) {
                Some((name, arguments)) => events.push(ToolCallEvent::Call(self.make_call(name, arguments))),
                None => {
                    let whitespace = std::mem::take(&mut self.whitespace_before_call);
                    self.push_content(&mut events, format!("{whitespace}{CALL_START}{held}"));
                }
            }
        } else if !self.after_call || !held.trim().is_empty() {
            self.push_content(&mut events, held);
        }
        events
    }

    fn make_call(&mut self, name: String, arguments: Map<String, Json>) -> ToolCall {
        self.whitespace_before_call.clear();
        self.after_call = true;
        let arguments = Json::Object(arguments).to_string();
        ToolCall {
            id: self.ids.next_id(),
            name,
            arguments,
        }
    }

    fn push_content(&mut self, events: &mut Vec<ToolCallEvent>, text: String) {
        if !text.is_empty() {
            self.after_call = false;
            events.push(ToolCallEvent::Content(text));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn weather_tools() -> Vec<Json> {
        vec![json!({
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string"},
                        "days": {"type": "integer"},
                        "scale": {"type": "number"},
                        "metric": {"type": "boolean"},
                        "options": {"type": "object"},
                        "hours": {"type": "array"},
                        "note": {"type": ["null", "string"]},
                        "code": {"anyOf": [{"type": "integer"}, {"type": "string"}]}
                    }
                }
            }
        })]
    }

    fn parse(chunks: &[&str]) -> (String, Vec<ToolCall>) {
        let mut parser = ToolCallParser::new(&weather_tools(), ToolCallIds::Sequential);
        let mut events: Vec<ToolCallEvent> = chunks.iter().flat_map(|chunk| parser.push(chunk)).collect();
        events.extend(parser.finish());
        let mut content = String::new();
        let mut calls = Vec::new();
        for event in events {
            match event {
                ToolCallEvent::Content(text) => content.push_str(&text),
                ToolCallEvent::Call(call) => calls.push(call),
            }
        }
        (content, calls)
    }

    fn call(id: usize, name: &str, arguments: Json) -> ToolCall {
        ToolCall {
            id: format!("call_{id}"),
            name: name.into(),
            arguments: arguments.to_string(),
        }
    }

    #[test]
    fn xml_call_with_typed_parameters() {
        let output = "Checking.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=scale>\n1.5\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n<parameter=options>\n{\"a\": [1, 2]}\n</parameter>\n<parameter=hours>\n[9, 12]\n</parameter>\n<parameter=note>\nnull\n</parameter>\n<parameter=code>\nA7\n</parameter>\n</function>\n</tool_call>";
        let (content, calls) = parse(&[output]);
        assert_eq!(content, "Checking.");
        assert_eq!(
            calls,
            vec![call(
                0,
                "get_weather",
                json!({
                    "city": "San Francisco", "days": 3, "scale": 1.5, "metric": true,
                    "options": {"a": [1, 2]}, "hours": [9, 12], "note": null, "code": "A7"
                })
            )]
        );
    }

    #[test]
    fn values_that_do_not_parse_stay_strings() {
        let output = "<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n<parameter=metric>\nyes\n</parameter>\n<parameter=options>\n[1]\n</parameter>\n<parameter=unknown>\n42\n</parameter>\n<parameter=city>\n 12 \n</parameter>\n</function>\n</tool_call>";
        let (_, calls) = parse(&[output]);
        assert_eq!(
            calls,
            vec![call(
                0,
                "get_weather",
                json!({
                    "days": "three", "metric": "yes", "options": "[1]", "unknown": "42", "city": " 12 "
                })
            )]
        );
    }

    #[test]
    fn multi_line_values_keep_inner_newlines() {
        let output = "<tool_call>\n<function=write>\n<parameter=text>\n\nline 1\nline 2\n\n</parameter>\n</function>\n</tool_call>";
        let (_, calls) = parse(&[output]);
        assert_eq!(calls, vec![call(0, "write", json!({"text": "\nline 1\nline 2\n"}))]);
    }

    #[test]
    fn parallel_calls_and_whitespace_between_them() {
        let one =
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>";
        let two = "<tool_call>\n<function=get_time>\n</function>\n</tool_call>";
        let output = format!("{one}\n{two}\n");
        let (content, calls) = parse(&[&output]);
        assert_eq!(content, "");
        assert_eq!(
            calls,
            vec![
                call(0, "get_weather", json!({"city": "Paris"})),
                call(1, "get_time", json!({}))
            ]
        );
    }

    #[test]
    fn json_form_of_older_qwen_models() {
        let output = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\", \"days\": 2}}\n</tool_call>\n<tool_call>\n{\"name\": \"f\", \"arguments\": \"{\\\"x\\\": 1}\"}\n</tool_call>";
        let (content, calls) = parse(&[output]);
        assert_eq!(content, "");
        assert_eq!(
            calls,
            vec![
                call(0, "get_weather", json!({"city": "Oslo", "days": 2})),
                call(1, "f", json!({"x": 1}))
            ]
        );
    }

    #[test]
    fn malformed_calls_become_content() {
        for body in [
            "<tool_call>\nnot a call\n</tool_call>",
            "<tool_call>\n<function=>\n</function>\n</tool_call>",
            "<tool_call>\n{\"name\": 3}\n</tool_call>",
            "<tool_call>\n{\"arguments\": {}}\n</tool_call>",
            "<tool_call>\n<function=f>\n<oops>\n</function>\n</tool_call>",
            "<tool_call>\n<function=f>\n</function>\ntrailing\n</tool_call>",
        ] {
            let (content, calls) = parse(&["Text ", body]);
            assert_eq!(calls, vec![], "{body}");
            assert_eq!(content, format!("Text {body}"), "{body}");
        }
    }

    #[test]
    fn unfinished_calls_become_content() {
        let cut = "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar";
        assert_eq!(parse(&["Hi ", cut]), (format!("Hi {cut}"), vec![]));
        assert_eq!(parse(&["Hi <tool_c"]), ("Hi <tool_c".to_string(), vec![]));
        // The function is complete; only the closing tag is missing.
        let no_close = "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n";
        assert_eq!(
            parse(&[no_close]),
            (String::new(), vec![call(0, "get_weather", json!({"city": "Rome"}))])
        );
    }

    #[test]
    fn text_after_a_call_is_content_and_trailing_whitespace_is_kept_without_calls() {
        let output = "<tool_call>\n<function=f>\n</function>\n</tool_call>\n\nDone.\n";
        assert_eq!(parse(&[output]), ("Done.\n".to_string(), vec![call(0, "f", json!({}))]));
        assert_eq!(parse(&["Plain answer.\n\n"]), ("Plain answer.\n\n".to_string(), vec![]));
    }

    #[test]
    fn missing_parameter_end_is_tolerated() {
        let output = "<tool_call>\n<function=get_weather>\n<parameter=city>\nLima\n<parameter=days>\n2\n</function>\n</tool_call>";
        assert_eq!(
            parse(&[output]).1,
            vec![call(0, "get_weather", json!({"city": "Lima", "days": 2}))]
        );
    }

    #[test]
    fn random_ids_are_unique() {
        let mut maker = CallIdMaker {
            kind: ToolCallIds::Random,
            made: 0,
        };
        let ids: std::collections::HashSet<String> = (0..1000).map(|_| maker.next_id()).collect();
        assert_eq!(ids.len(), 1000);
        assert!(ids.iter().all(|id| id.len() == 29
            && id.starts_with("call_")
            && id[5..].chars().all(|ch| ch.is_ascii_alphanumeric())));
    }
}
