//! Bad input gets OpenAI's error body with the right status, and never poisons the server for the next request.

mod common;

use common::*;
use serde_json::{json, Value as Json};

fn ok_body() -> Json {
    json!({"messages": [{"role": "user", "content": "Good morrow."}], "max_tokens": 2, "temperature": 0})
}

fn with(field: &str, value: Json) -> Json {
    let mut body = ok_body();
    body[field] = value;
    body
}

#[tokio::test]
async fn every_bad_request_is_an_openai_error() {
    let mut c = config();
    c.context = Some(256);
    c.max_body_bytes = 64 * 1024;
    let s = TestServer::real(c).await;
    let long = "Speak, speak! ".repeat(200);
    // (body, status, param)
    let cases: Vec<(Json, u16, Option<&str>)> = vec![
        (json!({}), 400, Some("messages")),
        (json!([1, 2]), 400, None),
        (json!({"messages": []}), 400, Some("messages")),
        (json!({"messages": "hello"}), 400, Some("messages")),
        (json!({"messages": [42]}), 400, Some("messages[0]")),
        (json!({"messages": [{"content": "hi"}]}), 400, Some("messages[0].role")),
        (
            json!({"messages": [{"role": "wizard", "content": "hi"}]}),
            400,
            Some("messages[0].role"),
        ),
        (
            json!({"messages": [{"role": "user"}]}),
            400,
            Some("messages[0].content"),
        ),
        (
            json!({"messages": [{"role": "user", "content": 7}]}),
            400,
            Some("messages[0].content"),
        ),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
            400,
            Some("messages[0].content[0]"),
        ),
        // The template's own refusal: no user message.
        (
            json!({"messages": [{"role": "system", "content": "Be brief."}]}),
            400,
            Some("messages"),
        ),
        (
            json!({"messages": [{"role": "user", "content": long}], "max_tokens": 1}),
            400,
            Some("messages"),
        ),
        (with("max_tokens", json!(0)), 400, Some("max_tokens")),
        (with("max_tokens", json!(-5)), 400, Some("max_tokens")),
        (with("max_tokens", json!(100000)), 400, Some("max_tokens")),
        (
            with("max_completion_tokens", json!(0)),
            400,
            Some("max_completion_tokens"),
        ),
        (with("max_tokens", json!("ten")), 400, Some("max_tokens")),
        (with("temperature", json!(-1)), 400, Some("temperature")),
        (with("temperature", json!("hot")), 400, Some("temperature")),
        (with("top_p", json!(-0.1)), 400, Some("top_p")),
        (with("top_p", json!(1.5)), 400, Some("top_p")),
        (with("top_k", json!(-3)), 400, Some("top_k")),
        (with("min_p", json!(2)), 400, Some("min_p")),
        (with("presence_penalty", json!(3)), 400, Some("presence_penalty")),
        (with("frequency_penalty", json!(-2.5)), 400, Some("frequency_penalty")),
        (with("repetition_penalty", json!(0)), 400, Some("repetition_penalty")),
        (with("n", json!(0)), 400, Some("n")),
        (with("n", json!(1000)), 400, Some("n")),
        (with("seed", json!("abc")), 400, Some("seed")),
        (with("stop", json!(5)), 400, Some("stop")),
        (with("stop", json!(vec!["zq"; 33])), 400, Some("stop")),
        (with("stop", json!(["z".repeat(1025)])), 400, Some("stop")),
        (with("top_logprobs", json!(3)), 400, Some("top_logprobs")),
        (
            json!({"messages": ok_body()["messages"], "logprobs": true, "top_logprobs": 50}),
            400,
            Some("top_logprobs"),
        ),
        (with("logit_bias", json!({"abc": 1})), 400, Some("logit_bias")),
        (with("logit_bias", json!({"5": 1000})), 400, Some("logit_bias")),
        (
            with("stream_options", json!({"include_usage": true})),
            400,
            Some("stream_options"),
        ),
        (
            with(
                "response_format",
                json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}}),
            ),
            400,
            Some("response_format"),
        ),
        (
            with("response_format", json!({"type": "yaml"})),
            400,
            Some("response_format"),
        ),
        (
            with("reasoning_effort", json!("maximum")),
            400,
            Some("reasoning_effort"),
        ),
        (with("tools", json!([{"type": "function"}])), 400, Some("tools[0]")),
        (
            with("tools", json!([{"type": "retrieval", "function": {"name": "f"}}])),
            400,
            Some("tools[0]"),
        ),
        (with("tool_choice", json!("required")), 400, Some("tool_choice")),
        (with("tool_choice", json!("sometimes")), 400, Some("tool_choice")),
        // As the OpenAI API: any `tool_choice`, even "auto" or "none", needs `tools`.
        (with("tool_choice", json!("auto")), 400, Some("tool_choice")),
        (with("tool_choice", json!("none")), 400, Some("tool_choice")),
        (
            json!({"messages": ok_body()["messages"], "tools": [{"type": "function", "function": {"name": "f"}}],
                   "tool_choice": {"type": "function", "function": {"name": "g"}}}),
            400,
            Some("tool_choice"),
        ),
        (
            json!({"messages": [{"role": "user", "content": "hi"},
                                {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function",
                                  "function": {"name": "f", "arguments": "not json"}}]}]}),
            400,
            Some("messages"),
        ),
        (
            with("functions", json!([{"name": "f", "parameters": {}}])),
            400,
            Some("functions"),
        ),
        // Beside a response_format, tool calls stay open and are enforced: a tool whose schema cannot be is the
        // tools' fault.
        (
            json!({"messages": ok_body()["messages"], "response_format": {"type": "json_object"},
                   "tools": [{"type": "function", "function": {"name": "f", "parameters":
                       {"type": "object", "properties": {}, "required": ["x"]}}}]}),
            400,
            Some("tools"),
        ),
        (with("model", json!("gpt-4o")), 404, Some("model")),
    ];
    for (body, status, param) in cases {
        let (got, response) = s.post("/v1/chat/completions", &body).await;
        assert_eq!(got, status, "{body} -> {response}");
        assert_error_shape(&response);
        assert_eq!(response["error"]["param"].as_str(), param, "{body} -> {response}");
    }
    // OpenAI's most choices a prompt is allowed.
    let (got, response) = s.post("/v1/chat/completions", &with("n", json!(128))).await;
    assert_eq!(got, 200, "{response}");
    assert_eq!(response["choices"].as_array().unwrap().len(), 128);
    // The stop strings' limits themselves are allowed.
    let most_stops: Vec<String> = (0..32)
        .map(|i| format!("{i}").repeat(1024)[..1024].to_string())
        .collect();
    let (got, response) = s.post("/v1/chat/completions", &with("stop", json!(most_stops))).await;
    assert_eq!(got, 200, "{response}");

    // Malformed JSON, and a body that is not JSON at all.
    for raw in ["{\"messages\": [", "not json", ""] {
        let response = s
            .client
            .post(s.url("/v1/chat/completions"))
            .header("content-type", "application/json")
            .body(raw)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 400, "{raw:?}");
        assert_error_shape(&response.json::<Json>().await.unwrap());
    }
    // Oversized body: 413.
    let huge = json!({"messages": [{"role": "user", "content": "x".repeat(100 * 1024)}]});
    let (status, response) = s.post("/v1/chat/completions", &huge).await;
    assert_eq!(status, 413, "{response}");
    assert_error_shape(&response);
    // Completions' own bad inputs.
    for (body, param) in [
        (json!({"max_tokens": 2}), "prompt"),
        (json!({"prompt": ""}), "prompt"),
        (json!({"prompt": []}), "prompt"),
        (json!({"prompt": [999999999]}), "prompt"),
        (json!({"prompt": "a", "max_tokens": 0}), "max_tokens"),
        (json!({"prompt": "a", "logprobs": 99}), "logprobs"),
        (json!({"prompt": "a", "suffix": "b"}), "suffix"),
        (json!({"prompt": "a", "best_of": 3}), "best_of"),
        (json!({"prompt": long, "max_tokens": 1}), "prompt"),
    ] {
        let (status, response) = s.post("/v1/completions", &body).await;
        assert_eq!(status, 400, "{body} -> {response}");
        assert_eq!(response["error"]["param"], param, "{response}");
    }

    // None of that poisoned the server: unknown fields are ignored, and a normal request works.
    let mut body = ok_body();
    body["some_future_field"] = json!({"nested": [1, 2]});
    body["user"] = json!("someone");
    body["response_format"] = json!({"type": "text"});
    let (status, response) = s.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{response}");
    let (status, _) = s.get("/health").await;
    assert_eq!(status, 200);
    s.shutdown().await;
}

#[tokio::test]
async fn api_key_is_required_where_set() {
    let mut c = config();
    c.api_key = Some("sekrit".into());
    let s = TestServer::real(c).await;
    let url = s.url("/v1/chat/completions");
    for auth in [None, Some("Bearer wrong"), Some("sekrit"), Some("Basic sekrit")] {
        let mut request = s.client.post(&url).json(&ok_body());
        if let Some(auth) = auth {
            request = request.header("authorization", auth);
        }
        let response = request.send().await.unwrap();
        assert_eq!(response.status(), 401, "{auth:?}");
        let body: Json = response.json().await.unwrap();
        assert_error_shape(&body);
        assert_eq!(body["error"]["code"], "invalid_api_key");
    }
    let response = s
        .client
        .post(&url)
        .bearer_auth("sekrit")
        .json(&ok_body())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(s.client.get(s.url("/v1/models")).send().await.unwrap().status(), 401);
    let tokenize = s
        .client
        .post(s.url("/tokenize"))
        .json(&json!({"prompt": "a"}))
        .send()
        .await
        .unwrap();
    assert_eq!(tokenize.status(), 401);
    // Health and metrics stay open for probes and scrapers.
    assert_eq!(s.get("/health").await.0, 200);
    assert_eq!(s.get("/metrics").await.0, 200);
    s.shutdown().await;
}
