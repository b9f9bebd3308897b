//! Structured outputs against the real default model (lily-tiny-shakespeare on the CPU backend), over loopback: a
//! model trained on plays still answers in JSON that the schema accepts, in a tool call when one is required, and
//! in exactly the regex, choice or grammar asked for.

mod common;

use common::*;
use lily_server::ServerConfig;
use serde_json::{json, Value as Json};

fn chat(extra: Json) -> Json {
    let mut body = json!({
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": "Describe a city in JSON."}],
        "max_tokens": 160,
        "temperature": 0,
        "chat_template_kwargs": {"enable_thinking": false},
    });
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

fn city_schema() -> Json {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
            "kind": {"enum": ["town", "city", "village"]},
            "districts": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3},
            "coastal": {"type": "boolean"}
        },
        "required": ["name", "population", "kind", "districts"],
        "additionalProperties": false
    })
}

fn content(r: &Json) -> &str {
    r["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_else(|| panic!("no content: {r}"))
}

/// The schema's checks, written out for `city_schema` (the server crate has no JSON Schema validator; the
/// structured crate's tests validate with one).
fn check_city(value: &Json) {
    let object = value.as_object().unwrap_or_else(|| panic!("not an object: {value}"));
    for key in object.keys() {
        assert!(
            ["name", "population", "kind", "districts", "coastal"].contains(&key.as_str()),
            "{value}"
        );
    }
    assert!(
        object["name"].as_str().is_some_and(|s| s.chars().count() <= 12),
        "{value}"
    );
    assert!(
        object["population"].as_u64().is_some_and(|p| p <= 100_000_000),
        "{value}"
    );
    assert!(
        ["town", "city", "village"].contains(&object["kind"].as_str().unwrap()),
        "{value}"
    );
    let districts = object["districts"].as_array().unwrap();
    assert!((1..=3).contains(&districts.len()), "{value}");
    assert!(
        districts
            .iter()
            .all(|d| d.as_str().is_some_and(|s| s.chars().count() <= 8)),
        "{value}"
    );
    assert!(object.get("coastal").is_none_or(Json::is_boolean), "{value}");
}

#[tokio::test]
async fn json_schema_json_object_and_streaming() {
    // The trie is built while the weights load, as `lily serve` does (the other tests build it at their first
    // constrained request).
    let s = TestServer::real(ServerConfig {
        structured_at_start: true,
        ..config()
    })
    .await;
    let format =
        json!({"type": "json_schema", "json_schema": {"name": "city", "schema": city_schema(), "strict": true}});
    let (status, r) = s
        .post("/v1/chat/completions", &chat(json!({"response_format": format})))
        .await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["choices"][0]["finish_reason"], "stop", "{r}");
    let text = content(&r).to_string();
    check_city(&serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}")));

    // Streamed: the same text, in content deltas.
    let (status, events) = s
        .stream(
            "/v1/chat/completions",
            &chat(json!({"response_format": format, "stream": true})),
        )
        .await;
    assert_eq!(status, 200);
    let streamed: String = events
        .iter()
        .filter(|e| *e != "[DONE]")
        .filter_map(|e| serde_json::from_str::<Json>(e).ok())
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str().map(str::to_string))
        .collect();
    assert_eq!(streamed, text);

    // Sampled (seeded) rather than greedy: still valid.
    for seed in 0..3 {
        let (_, r) = s
            .post(
                "/v1/chat/completions",
                &chat(json!({"response_format": format, "temperature": 1.0, "seed": seed})),
            )
            .await;
        if r["choices"][0]["finish_reason"] == "stop" {
            check_city(&serde_json::from_str(content(&r)).unwrap());
        }
    }

    // JSON mode: an object.
    let (_, r) = s
        .post(
            "/v1/chat/completions",
            &chat(json!({"response_format": {"type": "json_object"}, "max_tokens": 300})),
        )
        .await;
    let text = content(&r);
    assert!(text.starts_with('{'), "{text}");
    if r["choices"][0]["finish_reason"] == "stop" {
        assert!(serde_json::from_str::<Json>(text).unwrap().is_object());
    }

    // Cut by max_tokens: finish_reason length, the JSON incomplete.
    let (_, r) = s
        .post(
            "/v1/chat/completions",
            &chat(json!({"response_format": format, "max_tokens": 3})),
        )
        .await;
    assert_eq!(r["choices"][0]["finish_reason"], "length");
    assert!(content(&r).starts_with('{'));
    s.shutdown().await;
}

#[tokio::test]
async fn thinking_on_leaves_the_reasoning_free() {
    let s = TestServer::real(config()).await;
    // With thinking on, the output starts in the think block: the constraint waits for `</think>`, and the
    // end-of-turn tokens are refused until then, so the bundled model (which rarely closes the block) runs to
    // max_tokens.
    let (_, r) = s
        .post(
            "/v1/chat/completions",
            &chat(json!({
                "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": city_schema()}},
                "chat_template_kwargs": {"enable_thinking": true},
                "max_tokens": 24,
            })),
        )
        .await;
    let choice = &r["choices"][0];
    match choice["finish_reason"].as_str() {
        Some("length") => {}
        Some("stop") => check_city(&serde_json::from_str(content(&r)).unwrap()),
        other => panic!("{other:?}: {r}"),
    }
    s.shutdown().await;
}

fn tools() -> Json {
    json!([
        {"type": "function", "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 12},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}
                },
                "required": ["city", "days"]
            }
        }},
        {"type": "function", "function": {
            "name": "get_time",
            "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}}, "required": ["zone"]}
        }}
    ])
}

#[tokio::test]
async fn required_and_named_tool_choice_return_valid_calls() {
    let s = TestServer::real(config()).await;
    for (choice, parallel) in [
        (json!("required"), false),
        (json!("required"), true),
        (json!({"type": "function", "function": {"name": "get_time"}}), false),
    ] {
        let body = chat(json!({
            "messages": [{"role": "user", "content": "Weather in Verona?"}],
            "tools": tools(),
            "tool_choice": choice,
            "parallel_tool_calls": parallel,
            "max_tokens": 200,
        }));
        let (status, r) = s.post("/v1/chat/completions", &body).await;
        assert_eq!(status, 200, "{r}");
        assert_eq!(r["choices"][0]["finish_reason"], "tool_calls", "{r}");
        let calls = r["choices"][0]["message"]["tool_calls"].as_array().unwrap();
        assert!(!calls.is_empty());
        if !parallel {
            assert_eq!(calls.len(), 1, "{r}");
        }
        for call in calls {
            let name = call["function"]["name"].as_str().unwrap();
            let arguments: Json = serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
            match name {
                "get_weather" => {
                    assert!(choice == "required");
                    assert!(
                        arguments["city"].as_str().is_some_and(|c| c.chars().count() <= 12),
                        "{arguments}"
                    );
                    assert!(
                        arguments["days"].as_i64().is_some_and(|d| (1..=7).contains(&d)),
                        "{arguments}"
                    );
                    assert!(
                        arguments
                            .get("unit")
                            .is_none_or(|u| u == "celsius" || u == "fahrenheit"),
                        "{arguments}"
                    );
                }
                "get_time" => assert!(arguments["zone"].as_str().is_some_and(|z| z.chars().count() <= 6)),
                other => panic!("unknown function {other}"),
            }
        }
        // Streamed: the same calls.
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        let (_, events) = s.stream("/v1/chat/completions", &streamed).await;
        let arguments: String = events
            .iter()
            .filter_map(|e| serde_json::from_str::<Json>(e).ok())
            .filter_map(|c| {
                c["choices"][0]["delta"]["tool_calls"].as_array().map(|calls| {
                    calls
                        .iter()
                        .filter_map(|t| t["function"]["arguments"].as_str())
                        .collect::<String>()
                })
            })
            .collect();
        let whole: String = calls
            .iter()
            .map(|c| c["function"]["arguments"].as_str().unwrap())
            .collect();
        assert_eq!(arguments, whole);
    }
    s.shutdown().await;
}

/// With tools the model may call (`tool_choice` auto) and a `response_format`, the format binds the answer but not
/// the calls: a reply that opens a tool call is a valid call, and one that does not is JSON the schema accepts. The
/// bias on the `<tool_call>` token picks the way.
#[tokio::test]
async fn a_response_format_leaves_tool_calls_open() {
    let s = TestServer::real(config()).await;
    let opening = tokenizer().special().tool_call_start.to_string();
    for bias in [100, -100] {
        let body = chat(json!({
            "messages": [{"role": "user", "content": "Weather in Verona, as JSON?"}],
            "tools": tools(),
            "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": city_schema()}},
            "logit_bias": {opening.clone(): bias},
            "parallel_tool_calls": false,
            "max_tokens": 200,
        }));
        let (status, r) = s.post("/v1/chat/completions", &body).await;
        assert_eq!(status, 200, "{r}");
        let message = &r["choices"][0]["message"];
        if bias > 0 {
            assert_eq!(r["choices"][0]["finish_reason"], "tool_calls", "{r}");
            let calls = message["tool_calls"].as_array().unwrap();
            assert_eq!(calls.len(), 1, "{r}");
            let arguments: Json = serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
            match calls[0]["function"]["name"].as_str().unwrap() {
                "get_weather" => {
                    assert!(
                        arguments["city"].as_str().is_some_and(|c| c.chars().count() <= 12),
                        "{r}"
                    );
                    assert!(arguments["days"].as_i64().is_some_and(|d| (1..=7).contains(&d)), "{r}");
                }
                "get_time" => assert!(
                    arguments["zone"].as_str().is_some_and(|z| z.chars().count() <= 6),
                    "{r}"
                ),
                other => panic!("unknown function {other}"),
            }
        } else {
            assert!(message.get("tool_calls").is_none_or(Json::is_null), "{r}");
            check_city(&serde_json::from_str(content(&r)).unwrap_or_else(|e| panic!("{e}: {r}")));
        }
    }
    s.shutdown().await;
}

#[tokio::test]
async fn vllm_structured_outputs_and_completions() {
    let s = TestServer::real(config()).await;
    let (_, r) = s
        .post(
            "/v1/chat/completions",
            &chat(json!({"structured_outputs": {"choice": ["Montague", "Capulet"]}})),
        )
        .await;
    assert!(["Montague", "Capulet"].contains(&content(&r)), "{r}");
    let (_, r) = s
        .post(
            "/v1/chat/completions",
            &chat(json!({"structured_outputs": {"regex": "Act [IVX]{1,4}, scene [1-9]"}})),
        )
        .await;
    let text = content(&r);
    assert!(text.starts_with("Act ") && text.contains(", scene "), "{text}");
    let (_, r) = s
        .post(
            "/v1/chat/completions",
            &chat(json!({"structured_outputs": {"grammar": "start: \"To \" VERB \" or not to \" VERB\nVERB: /[a-z]{2,6}/"}})),
        )
        .await;
    assert!(
        content(&r).starts_with("To ") && content(&r).contains(" or not to "),
        "{r}"
    );
    let (_, r) = s
        .post(
            "/v1/chat/completions",
            &chat(json!({"structured_outputs": {"json": city_schema()}})),
        )
        .await;
    check_city(&serde_json::from_str(content(&r)).unwrap());
    // Completions take the same fields.
    let (status, r) = s
        .post(
            "/v1/completions",
            &json!({"model": MODEL_ID, "prompt": "ROMEO.\n", "max_tokens": 20, "temperature": 0,
                    "structured_outputs": {"choice": ["yes", "no"]}}),
        )
        .await;
    assert_eq!(status, 200, "{r}");
    assert!(
        ["yes", "no"].contains(&r["choices"][0]["text"].as_str().unwrap()),
        "{r}"
    );
    s.shutdown().await;
}

#[tokio::test]
async fn bad_constraints_are_400_before_generation() {
    let s = TestServer::real(config()).await;
    let cases = [
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}}}),
            "response_format",
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 3, "maximum": 1}}}}),
            "response_format",
        ),
        (json!({"response_format": {"type": "json_schema"}}), "response_format"),
        (json!({"structured_outputs": {"regex": "[a-"}}), "structured_outputs"),
        (
            json!({"structured_outputs": {"grammar": "start: nothing_here"}}),
            "structured_outputs",
        ),
        (
            json!({"structured_outputs": {"choice": []}}),
            "structured_outputs.choice",
        ),
        (
            json!({"structured_outputs": {"regex": "a", "choice": ["b"]}}),
            "structured_outputs",
        ),
        (
            json!({"structured_outputs": {"structural_tag": "{}"}}),
            "structured_outputs.structural_tag",
        ),
        (
            json!({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}),
            "structured_outputs",
        ),
    ];
    for (extra, param) in cases {
        let (status, r) = s.post("/v1/chat/completions", &chat(extra.clone())).await;
        assert_eq!(status, 400, "{extra}: {r}");
        assert_eq!(r["error"]["param"], param, "{extra}: {r}");
        assert!(!r["error"]["message"].as_str().unwrap().is_empty());
    }
    // Nothing was generated for them.
    let (_, metrics) = s.get("/metrics").await;
    let generated: f64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("lily_generation_tokens_total "))
        .map_or(0.0, |v| v.trim().parse().unwrap());
    assert_eq!(generated, 0.0, "{metrics}");
    s.shutdown().await;
}
