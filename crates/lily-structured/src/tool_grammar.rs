//! The Lark grammar of a tool call in the XML form that the chat template teaches and `lily_chat::tool_call` parses:
//!
//! ```text
//! <tool_call>
//! <function=NAME>
//! <parameter=ARG>
//! VALUE
//! </parameter>
//! </function>
//! </tool_call>
//! ```
//!
//! `<tool_call>` and `</tool_call>` are special tokens. Each function's parameters come in the order of its schema's
//! `properties`, the required ones always and the others optionally, and no other parameter. A value is written as
//! the template writes it: a parameter whose schema allows a string is raw text (the parser keeps text as a string),
//! any other is compact JSON that its schema accepts (the parser reads it back as JSON).

use lily_chat::tool_call::schema_types;
use serde_json::{Map, Value as Json};

use crate::{json_layout, ConstraintError};

/// A Lark string literal for `text` (JSON's escapes, which Lark reads the same way).
pub(crate) fn literal(text: &str) -> String {
    serde_json::to_string(text).expect("a string serializes")
}

/// `text` escaped for a regular expression inside a Lark `/.../` literal.
fn regex_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for ch in text.chars() {
        match ch {
            '\\' | '.' | '+' | '*' | '?' | '(' | ')' | '|' | '[' | ']' | '{' | '}' | '^' | '$' | '#' | '&' | '-'
            | '~' | '/' => {
                out.push('\\');
                out.push(ch);
            }
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            _ => out.push(ch),
        }
    }
    out
}

/// The string branch of a schema that allows strings: itself, or its first `anyOf`/`oneOf` branch of type string.
fn string_branch(schema: &Json) -> &Json {
    if schema.get("type").is_some() {
        return schema;
    }
    ["anyOf", "oneOf"]
        .iter()
        .filter_map(|key| schema.get(*key).and_then(Json::as_array))
        .flatten()
        .find(|branch| schema_types(branch).iter().any(|t| t == "string"))
        .unwrap_or(schema)
}

/// A regular expression for a raw-text value followed by the parameter's closing tag. The value holds no `<` (the
/// parser would read one as the start of a tag); `enum`, `const`, `minLength`, `maxLength` and an anchored
/// `pattern` narrow it further.
fn text_value_regex(schema: &Json, param: &str) -> Result<String, ConstraintError> {
    let schema = string_branch(schema);
    let close = "\\n<\\/parameter>\\n";
    let listed: Option<Vec<&str>> = match (schema.get("const"), schema.get("enum")) {
        (Some(Json::String(value)), _) => Some(vec![value.as_str()]),
        (_, Some(Json::Array(values))) => Some(values.iter().filter_map(Json::as_str).collect()),
        _ => None,
    };
    if let Some(values) = listed {
        if values.is_empty() {
            return Err(ConstraintError::Invalid(format!(
                "the parameter {param:?} has an `enum` with no string value"
            )));
        }
        let alternatives: Vec<String> = values.iter().map(|v| regex_escape(v)).collect();
        return Ok(format!("/(?:{}){close}/", alternatives.join("|")));
    }
    if let Some(pattern) = schema.get("pattern").and_then(Json::as_str) {
        let inner = pattern.strip_prefix('^').unwrap_or(pattern);
        let anchored_end = inner.ends_with('$') && !inner.ends_with("\\$");
        let inner = if anchored_end { &inner[..inner.len() - 1] } else { inner };
        let inner = llguidance::regex_to_lark(inner, "dw");
        let body = match (pattern.starts_with('^'), anchored_end) {
            (true, true) => format!("(?:{inner})"),
            (true, false) => format!("(?:{inner})[^<]*"),
            (false, true) => format!("[^<]*(?:{inner})"),
            (false, false) => format!("[^<]*(?:{inner})[^<]*"),
        };
        return Ok(format!("/{body}{close}/"));
    }
    let min = schema.get("minLength").and_then(Json::as_u64).unwrap_or(0);
    let repeat = match schema.get("maxLength").and_then(Json::as_u64) {
        Some(max) if max < min => {
            return Err(ConstraintError::Invalid(format!(
                "the parameter {param:?} has maxLength {max} below minLength {min}"
            )))
        }
        Some(max) => format!("{{{min},{max}}}"),
        None if min > 0 => format!("{{{min},}}"),
        None => "*".to_string(),
    };
    Ok(format!("/[^<]{repeat}{close}/"))
}

/// The Lark expression for one parameter's value and its closing tag.
fn value_expression(schema: &Json, defs: &Map<String, Json>, param: &str) -> Result<String, ConstraintError> {
    let types = schema_types(schema);
    if (types.is_empty() && schema.get("$ref").is_none()) || types.iter().any(|t| t == "string") {
        return text_value_regex(schema, param);
    }
    let mut schema = schema.clone();
    if let Some(object) = schema.as_object_mut() {
        // References into the parameters' `$defs` must still resolve in the value's own schema.
        for (key, value) in defs {
            object.entry(key.clone()).or_insert_with(|| value.clone());
        }
        object.insert("x-guidance".into(), json_layout());
    }
    let schema = serde_json::to_string(&schema).expect("a schema serializes");
    Ok(format!("%json {schema} {}", literal("\n</parameter>\n")))
}

/// The grammar of one or more calls to `tools` (`at_most_one`: exactly one), whose top rule is named `top`
/// (`start` for a grammar of tool calls alone).
pub(crate) fn lark(tools: &[Json], at_most_one: bool, top: &str) -> Result<String, ConstraintError> {
    if tools.is_empty() {
        return Err(ConstraintError::Invalid(
            "a tool call was asked for but there are no tools".into(),
        ));
    }
    let mut rules = Vec::new();
    let mut functions = Vec::new();
    for (i, tool) in tools.iter().enumerate() {
        let function = tool.get("function").unwrap_or(tool);
        let name = function
            .get("name")
            .and_then(Json::as_str)
            .ok_or_else(|| ConstraintError::Invalid(format!("tools[{i}] has no function name")))?;
        let parameters = function.get("parameters").cloned().unwrap_or(Json::Null);
        let empty = Map::new();
        let properties = parameters.get("properties").and_then(Json::as_object).unwrap_or(&empty);
        let required: Vec<&str> = parameters
            .get("required")
            .and_then(Json::as_array)
            .map(|r| r.iter().filter_map(Json::as_str).collect())
            .unwrap_or_default();
        if let Some(missing) = required.iter().find(|r| !properties.contains_key(**r)) {
            return Err(ConstraintError::Invalid(format!(
                "the function {name:?} requires the parameter {missing:?}, which is not in its `properties`"
            )));
        }
        let mut defs = Map::new();
        for key in ["$defs", "definitions"] {
            if let Some(value) = parameters.get(key) {
                defs.insert(key.to_string(), value.clone());
            }
        }
        let mut body = vec![literal(&format!("<function={name}>\n"))];
        for (j, (param, schema)) in properties.iter().enumerate() {
            let rule = format!("p{i}_{j}");
            let value = value_expression(schema, &defs, param)?;
            rules.push(format!(
                "{rule}: {} {value}",
                literal(&format!("<parameter={param}>\n"))
            ));
            body.push(if required.contains(&param.as_str()) {
                rule
            } else {
                format!("{rule}?")
            });
        }
        body.push(literal("</function>\n"));
        rules.push(format!("f{i}: {}", body.join(" ")));
        functions.push(format!("f{i}"));
    }
    let start = if at_most_one {
        format!("{top}: call")
    } else {
        format!("{top}: call (\"\\n\" call)*")
    };
    let mut grammar = vec![
        start,
        format!("call: <tool_call> \"\\n\" ({}) </tool_call>", functions.join(" | ")),
    ];
    grammar.extend(rules);
    Ok(grammar.join("\n"))
}
