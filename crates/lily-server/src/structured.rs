//! From a request's `response_format`, `tool_choice` and vLLM's `structured_outputs` to the constraint its output is
//! held to, compiled before any generation so that a bad schema, regex or grammar is a 400 naming the problem.

use lily_structured::{ConstraintError, ConstraintSpec, Grammar, StructuredEnv};
use serde_json::Value as Json;

use crate::error::ApiError;

/// `response_format`: `text` is free; `json_object` is any JSON object; `json_schema` is JSON its `schema` accepts
/// (a missing `schema` is any JSON object). `strict` changes nothing: the schema is always enforced.
pub fn response_format(format: Option<&Json>) -> Result<Option<ConstraintSpec>, ApiError> {
    let Some(format) = format.filter(|f| !f.is_null()) else {
        return Ok(None);
    };
    let bad = |message: &str| Err(ApiError::invalid("response_format", message));
    match format.get("type").and_then(Json::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(ConstraintSpec::JsonObject)),
        Some("json_schema") => {
            let Some(spec) = format.get("json_schema").filter(|s| s.is_object()) else {
                return bad("`response_format` of type `json_schema` needs a `json_schema` object");
            };
            if let Some(strict) = spec.get("strict") {
                if !(strict.is_boolean() || strict.is_null()) {
                    return bad("`response_format.json_schema.strict` must be a boolean");
                }
            }
            match spec.get("schema") {
                None | Some(Json::Null) => Ok(Some(ConstraintSpec::JsonObject)),
                Some(schema @ (Json::Object(_) | Json::Bool(_))) => {
                    Ok(Some(ConstraintSpec::JsonSchema(schema.clone())))
                }
                Some(_) => bad("`response_format.json_schema.schema` must be a JSON schema object"),
            }
        }
        _ => bad("`response_format.type` must be one of text, json_object, json_schema"),
    }
}

/// vLLM's `structured_outputs`: exactly one of `json` (a schema, as an object or as JSON text), `json_object`
/// (true), `regex`, `choice` (a list of strings) or `grammar` (llguidance's Lark syntax).
pub fn structured_outputs(value: Option<&Json>) -> Result<Option<ConstraintSpec>, ApiError> {
    let Some(value) = value.filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let param = "structured_outputs";
    let Some(fields) = value.as_object() else {
        return Err(ApiError::invalid(param, "`structured_outputs` must be an object"));
    };
    let given: Vec<(&String, &Json)> = fields
        .iter()
        .filter(|(key, v)| !v.is_null() && !matches!(key.as_str(), "whitespace_pattern" | "disable_any_whitespace"))
        .filter(|(key, v)| !(key.as_str() == "json_object" && **v == Json::Bool(false)))
        .collect();
    let [(key, v)] = given.as_slice() else {
        return Err(ApiError::invalid(
            param,
            "`structured_outputs` needs exactly one of json, json_object, regex, choice, grammar",
        ));
    };
    let field = |name: &str| format!("{param}.{name}");
    let spec = match key.as_str() {
        "json" => match v {
            Json::String(text) => match serde_json::from_str::<Json>(text) {
                Ok(schema) => ConstraintSpec::JsonSchema(schema),
                Err(e) => {
                    return Err(ApiError::invalid(
                        field("json"),
                        format!("`{param}.json` is not JSON: {e}"),
                    ))
                }
            },
            Json::Object(_) | Json::Bool(_) => ConstraintSpec::JsonSchema((*v).clone()),
            _ => return Err(ApiError::invalid(field("json"), "`json` must be a JSON schema")),
        },
        "json_object" if **v == Json::Bool(true) => ConstraintSpec::JsonObject,
        "regex" => match v.as_str() {
            Some(regex) => ConstraintSpec::Regex(regex.to_string()),
            None => return Err(ApiError::invalid(field("regex"), "`regex` must be a string")),
        },
        "choice" => match v
            .as_array()
            .map(|a| a.iter().map(Json::as_str).collect::<Option<Vec<_>>>())
        {
            Some(Some(choices)) if !choices.is_empty() => {
                ConstraintSpec::Choice(choices.into_iter().map(str::to_string).collect())
            }
            _ => {
                return Err(ApiError::invalid(
                    field("choice"),
                    "`choice` must be a non-empty array of strings",
                ))
            }
        },
        "grammar" => match v.as_str() {
            Some(grammar) => ConstraintSpec::Lark(grammar.to_string()),
            None => return Err(ApiError::invalid(field("grammar"), "`grammar` must be a string")),
        },
        other => {
            return Err(ApiError::invalid(
                field(other),
                format!("`{param}.{other}` is not supported: use json, json_object, regex, choice or grammar"),
            ))
        }
    };
    Ok(Some(spec))
}

/// Compiles the constraint; its problems are 400s on `param`.
pub fn compile(env: Option<&StructuredEnv>, spec: &ConstraintSpec, param: &str) -> Result<Grammar, ApiError> {
    let Some(env) = env else {
        return Err(ApiError::invalid(
            param,
            "constrained decoding is not available for this model (its tokenizer and vocabulary do not match)",
        ));
    };
    env.compile(spec).map_err(|e| {
        // Where tool calls stand beside an answer, the fault is the tools' when the answer compiles alone.
        let param = match spec {
            ConstraintSpec::ToolCallsOr { answer, .. } if env.compile(answer).is_ok() => "tools",
            _ => param,
        };
        match e {
            ConstraintError::Invalid(message) => {
                ApiError::invalid(param, format!("`{param}` cannot be enforced: {message}"))
                    .with_code("invalid_constraint")
            }
            other => ApiError::internal(other.to_string()),
        }
    })
}

/// The tool-call constraint for `tool_choice` `required` or a named function: calls to `tools` (already narrowed
/// to the named one), exactly one when `parallel_tool_calls` is false.
pub fn tool_calls(tools: &[Json], parallel_tool_calls: bool) -> ConstraintSpec {
    ConstraintSpec::ToolCalls {
        tools: tools.to_vec(),
        at_most_one: !parallel_tool_calls,
    }
}

/// Tool calls to `tools` (one at most without `parallel_tool_calls`) or an answer held to `answer`: the constraint
/// of a reply that may call tools (`tool_choice` auto) when the request also constrains the answer.
pub fn tool_calls_or(tools: &[Json], parallel_tool_calls: bool, answer: ConstraintSpec) -> ConstraintSpec {
    ConstraintSpec::ToolCallsOr {
        tools: tools.to_vec(),
        at_most_one: !parallel_tool_calls,
        answer: Box::new(answer),
    }
}

/// The constraint of a completions request: `response_format` (vLLM accepts it there too) or `structured_outputs`.
pub fn for_completion(
    response_format_field: Option<&Json>,
    structured_outputs_field: Option<&Json>,
) -> Result<Option<(ConstraintSpec, &'static str)>, ApiError> {
    either(
        response_format(response_format_field)?,
        structured_outputs(structured_outputs_field)?,
    )
}

/// At most one of the two fields may constrain the output.
pub fn either(
    response_format: Option<ConstraintSpec>,
    structured_outputs: Option<ConstraintSpec>,
) -> Result<Option<(ConstraintSpec, &'static str)>, ApiError> {
    match (response_format, structured_outputs) {
        (Some(_), Some(_)) => Err(ApiError::invalid(
            "structured_outputs",
            "`structured_outputs` and a `response_format` other than text cannot be combined",
        )),
        (Some(spec), None) => Ok(Some((spec, "response_format"))),
        (None, Some(spec)) => Ok(Some((spec, "structured_outputs"))),
        (None, None) => Ok(None),
    }
}
