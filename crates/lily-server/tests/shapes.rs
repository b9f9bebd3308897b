//! Exact response shapes, with a scripted fake backend that emits a fixed token sequence: tool-call streaming,
//! finish_reason=tool_calls, the reasoning split, logprobs, usage, and the loading state.

mod common;

use common::*;
use lily_server::ReasoningField;
use serde_json::{json, Value as Json};
use std::sync::{Arc, Mutex};

const WEATHER_CALL: &str =
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>";

fn weather_tools() -> Json {
    json!([{
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather forecast for a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"]
            }
        }
    }])
}

fn ask(extra: Json) -> Json {
    let mut body = json!({"model": MODEL_ID, "messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 200, "temperature": 0});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

#[tokio::test]
async fn tool_call_streaming_and_message_shapes() {
    let script = Script::text(&format!("Let me check the weather.\n</think>\n\n{WEATHER_CALL}"));
    let completion_tokens = script.tokens.len();
    // The think block's tokens: those up to `</think>`, the tag included.
    let think_end = tokenizer().special().think_end;
    let reasoning_tokens = 1 + script.tokens.iter().position(|&t| t == think_end).unwrap();
    let s = TestServer::fake(config(), script).await;
    // The script thinks first: thinking on (the bundled model's template has it off unless asked for).
    let thinking = json!({"enable_thinking": true});

    // Not streamed.
    let (status, r) = s
        .post(
            "/v1/chat/completions",
            &ask(json!({"tools": weather_tools(), "chat_template_kwargs": thinking})),
        )
        .await;
    assert_eq!(status, 200, "{r}");
    let choice = &r["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    let message = &choice["message"];
    assert_eq!(message["role"], "assistant");
    assert!(message["content"].is_null(), "{message}");
    // lily-chat's reasoning parser keeps the text before `</think>` as it is (vLLM's Qwen3 parser does too).
    assert_eq!(message["reasoning_content"], "Let me check the weather.\n");
    assert!(message.get("reasoning").is_none());
    let calls = message["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0]["id"], "call_0");
    assert_eq!(calls[0]["type"], "function");
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    let arguments: Json = serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(arguments, json!({"city": "Paris", "days": 3}), "typed from the schema");
    assert_eq!(
        r["usage"]["completion_tokens"].as_u64().unwrap() as usize,
        completion_tokens
    );
    assert_eq!(
        r["usage"]["completion_tokens_details"]["reasoning_tokens"]
            .as_u64()
            .unwrap() as usize,
        reasoning_tokens,
        "{r}"
    );

    // Streamed: role, reasoning deltas, then the call as OpenAI streams it: the first delta with index, id, type,
    // name and empty arguments, the next with arguments only.
    let (_, data) = s
        .stream(
            "/v1/chat/completions",
            &ask(json!({"tools": weather_tools(), "stream": true, "chat_template_kwargs": thinking})),
        )
        .await;
    let chunks = chunks(&data);
    assert_eq!(
        chunks[0]["choices"][0]["delta"],
        json!({"role": "assistant", "content": ""})
    );
    let mut reasoning = String::new();
    let mut call_deltas = Vec::new();
    for chunk in &chunks[1..] {
        let delta = &chunk["choices"][0]["delta"];
        if let Some(text) = delta["reasoning_content"].as_str() {
            reasoning.push_str(text);
        }
        assert!(delta.get("content").is_none(), "no content: {delta}");
        if let Some(calls) = delta["tool_calls"].as_array() {
            call_deltas.extend(calls.iter().cloned());
        }
    }
    assert_eq!(reasoning, "Let me check the weather.\n");
    assert_eq!(call_deltas.len(), 2, "{call_deltas:?}");
    assert_eq!(
        call_deltas[0],
        json!({"index": 0, "id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": ""}})
    );
    assert_eq!(call_deltas[1]["index"], 0);
    assert!(call_deltas[1].get("id").is_none() && call_deltas[1].get("type").is_none());
    assert!(call_deltas[1]["function"].get("name").is_none());
    assert_eq!(
        call_deltas[1]["function"]["arguments"],
        calls[0]["function"]["arguments"]
    );
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "tool_calls");
    assert_eq!(last["choices"][0]["delta"], json!({}));
    s.shutdown().await;
}

#[tokio::test]
async fn tool_choice_none_and_parallel_tool_calls() {
    let second = WEATHER_CALL.replace("Paris", "Rome");
    let script = Script::text(&format!("</think>\n\n{WEATHER_CALL}\n{second}"));
    let s = TestServer::fake(config(), script).await;

    // Both calls by default.
    let (_, r) = s
        .post("/v1/chat/completions", &ask(json!({"tools": weather_tools()})))
        .await;
    let calls = r["choices"][0]["message"]["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 2);
    assert_eq!(
        (calls[0]["id"].as_str(), calls[1]["id"].as_str()),
        (Some("call_0"), Some("call_1"))
    );

    // parallel_tool_calls false: only the first.
    let (_, r) = s
        .post(
            "/v1/chat/completions",
            &ask(json!({"tools": weather_tools(), "parallel_tool_calls": false})),
        )
        .await;
    assert_eq!(r["choices"][0]["message"]["tool_calls"].as_array().unwrap().len(), 1);
    assert_eq!(r["choices"][0]["finish_reason"], "tool_calls");
    let (_, data) = s
        .stream(
            "/v1/chat/completions",
            &ask(json!({"tools": weather_tools(), "parallel_tool_calls": false, "stream": true})),
        )
        .await;
    for chunk in chunks(&data) {
        for call in chunk["choices"][0]["delta"]["tool_calls"]
            .as_array()
            .into_iter()
            .flatten()
        {
            assert_eq!(call["index"], 0);
        }
    }

    // tool_choice none: tools are not rendered and calls are not parsed: the markup is plain content.
    let (_, with_tools) = s
        .post("/v1/chat/completions", &ask(json!({"tools": weather_tools()})))
        .await;
    let (_, r) = s
        .post(
            "/v1/chat/completions",
            &ask(json!({"tools": weather_tools(), "tool_choice": "none"})),
        )
        .await;
    let message = &r["choices"][0]["message"];
    assert!(message.get("tool_calls").is_none());
    assert!(message["content"].as_str().unwrap().contains("<function=get_weather>"));
    assert_eq!(r["choices"][0]["finish_reason"], "stop");
    assert!(
        r["usage"]["prompt_tokens"].as_u64() < with_tools["usage"]["prompt_tokens"].as_u64(),
        "tools not rendered"
    );

    // required and a named function: enforced, with an instruction added to the prompt too.
    let auto = with_tools["usage"]["prompt_tokens"].as_u64().unwrap();
    for choice in [
        json!("required"),
        json!({"type": "function", "function": {"name": "get_weather"}}),
    ] {
        let (status, r) = s
            .post(
                "/v1/chat/completions",
                &ask(json!({"tools": weather_tools(), "tool_choice": choice})),
            )
            .await;
        assert_eq!(status, 200, "{r}");
        assert!(r["usage"]["prompt_tokens"].as_u64().unwrap() > auto);
        assert_eq!(r["choices"][0]["finish_reason"], "tool_calls");
    }
    // response_format json_object: enforced, with an instruction added to the prompt too.
    let (_, plain) = s.post("/v1/chat/completions", &ask(json!({}))).await;
    let (status, r) = s
        .post(
            "/v1/chat/completions",
            &ask(json!({"response_format": {"type": "json_object"}})),
        )
        .await;
    assert_eq!(status, 200);
    assert!(r["usage"]["prompt_tokens"].as_u64() > plain["usage"]["prompt_tokens"].as_u64());
    s.shutdown().await;
}

#[tokio::test]
async fn reasoning_split_follows_enable_thinking_and_the_field_flag() {
    let mut c = config();
    c.reasoning_field = ReasoningField::Both;
    let s = TestServer::fake(c, Script::text("Hello there, friend.")).await;
    // Thinking on: the output starts inside the think block and never closes it. That text is the reasoning, and
    // the content too (the answer of a model that never closes its think block).
    let thinking = json!({"chat_template_kwargs": {"enable_thinking": true}});
    let (_, r) = s.post("/v1/chat/completions", &ask(thinking.clone())).await;
    let message = &r["choices"][0]["message"];
    assert_eq!(message["reasoning_content"], "Hello there, friend.");
    assert_eq!(message["reasoning"], "Hello there, friend.");
    assert_eq!(message["content"], "Hello there, friend.");
    assert_eq!(r["choices"][0]["finish_reason"], "stop");
    // Streamed: reasoning deltas as they come, then the same text as one content delta, before the finish chunk.
    let (_, data) = s
        .stream(
            "/v1/chat/completions",
            &ask(json!({"stream": true, "chat_template_kwargs": {"enable_thinking": true}})),
        )
        .await;
    let deltas: Vec<Json> = chunks(&data).iter().map(|c| c["choices"][0]["delta"].clone()).collect();
    assert!(deltas
        .iter()
        .any(|d| d["reasoning"] == d["reasoning_content"] && d["reasoning"].is_string()));
    let reasoning: String = deltas.iter().filter_map(|d| d["reasoning_content"].as_str()).collect();
    assert_eq!(reasoning, "Hello there, friend.");
    let content: Vec<&str> = deltas
        .iter()
        .filter_map(|d| d["content"].as_str())
        .filter(|text| !text.is_empty())
        .collect();
    assert_eq!(content, ["Hello there, friend."]);
    let (finish, before) = deltas.split_last().unwrap();
    assert_eq!(finish, &json!({}));
    assert_eq!(before.last().unwrap()["content"], "Hello there, friend.");

    // The bundled model's default (its template turns thinking off), reasoning_effort none / minimal, or
    // enable_thinking false: all content.
    for extra in [
        json!({}),
        json!({"reasoning_effort": "none"}),
        json!({"reasoning_effort": "minimal"}),
        json!({"chat_template_kwargs": {"enable_thinking": false}}),
        // An explicit chat_template_kwargs wins over reasoning_effort.
        json!({"chat_template_kwargs": {"enable_thinking": false}, "reasoning_effort": "high"}),
    ] {
        let (_, r) = s.post("/v1/chat/completions", &ask(extra.clone())).await;
        let message = &r["choices"][0]["message"];
        assert_eq!(message["content"], "Hello there, friend.", "{extra}");
        assert!(message["reasoning_content"].is_null(), "{extra}: {message}");
    }
    let (_, r) = s
        .post("/v1/chat/completions", &ask(json!({"reasoning_effort": "high"})))
        .await;
    assert_eq!(r["choices"][0]["message"]["reasoning_content"], "Hello there, friend.");
    s.shutdown().await;
}

#[tokio::test]
async fn logprobs_and_usage_are_exact() {
    let script = Script::text("Hello there, friend.");
    let tokens = script.tokens.clone();
    let runner_up = script.runner_up;
    let s = TestServer::fake(config(), script).await;
    let vocab = lily_model::Config::tiny_shape().vocab_size;
    let body = ask(
        json!({"logprobs": true, "top_logprobs": 2, "reasoning_effort": "none", "n": 2,
                          "stream": true, "stream_options": {"include_usage": true}}),
    );
    let (_, data) = s.stream("/v1/chat/completions", &body).await;
    let chunks = chunks(&data);
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(usage["completion_tokens"].as_u64().unwrap() as usize, 2 * tokens.len());
    // Thinking off: no token of the answer is counted as reasoning.
    assert_eq!(usage["completion_tokens_details"]["reasoning_tokens"], 0, "{usage}");
    let (_, r) = s
        .post(
            "/v1/chat/completions",
            &ask(json!({"logprobs": true, "top_logprobs": 2, "reasoning_effort": "none"})),
        )
        .await;
    let entries = r["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(
        entries.len(),
        tokens.len() - 1,
        "no entry for the end-of-sequence token"
    );
    let top_lp = scripted_logprob(10.0, vocab) as f64;
    let second_lp = scripted_logprob(8.0, vocab) as f64;
    let runner_up_text = lily_server::token_bytes::token_text(&tokenizer(), runner_up).0;
    let mut text = String::new();
    for entry in entries {
        assert!((entry["logprob"].as_f64().unwrap() - top_lp).abs() < 1e-4, "{entry}");
        let top = entry["top_logprobs"].as_array().unwrap();
        assert_eq!(top[0]["token"], entry["token"]);
        assert_eq!(top[1]["token"], runner_up_text.as_str());
        assert!((top[1]["logprob"].as_f64().unwrap() - second_lp).abs() < 1e-4);
        text.push_str(entry["token"].as_str().unwrap());
    }
    assert_eq!(text, "Hello there, friend.");
    assert_eq!(r["usage"]["completion_tokens"].as_u64().unwrap() as usize, tokens.len());
    s.shutdown().await;
}

#[tokio::test]
async fn health_is_503_while_loading() {
    let (release, gate) = std::sync::mpsc::channel::<()>();
    let mut script = Script::text("Hi.");
    script.load_gate = Some(Arc::new(Mutex::new(gate)));
    let s = TestServer::start(config(), script.factory()).await;
    let (status, body) = s.get("/health").await;
    assert_eq!(status, 503);
    assert_eq!(serde_json::from_str::<Json>(&body).unwrap()["status"], "loading");
    let response = s
        .client
        .post(s.url("/v1/chat/completions"))
        .json(&ask(json!({})))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 503);
    assert_eq!(response.headers()["retry-after"], "1");
    assert_error_shape(&response.json::<Json>().await.unwrap());
    drop(release);
    s.ready().await;
    assert_eq!(s.get("/health").await.0, 200);
    let (status, _) = s.post("/v1/chat/completions", &ask(json!({}))).await;
    assert_eq!(status, 200);
    s.shutdown().await;
}

#[tokio::test]
async fn a_model_whose_loading_panics_stops_the_server_with_the_panic() {
    let factory: lily_server::BackendFactory = Box::new(|_, _| panic!("a checkpoint that trips an assertion"));
    let s = TestServer::start(config(), factory).await;
    let server = s.server.unwrap();
    let error = tokio::time::timeout(std::time::Duration::from_secs(10), server.wait_ready())
        .await
        .expect("the load's end is reported")
        .unwrap_err();
    assert!(format!("{error:#}").contains("trips an assertion"), "{error:#}");
    let error = tokio::time::timeout(std::time::Duration::from_secs(10), server.wait())
        .await
        .expect("stops")
        .unwrap_err();
    assert!(format!("{error:#}").contains("trips an assertion"));
}

#[tokio::test]
async fn a_model_that_fails_to_load_stops_the_server_with_its_error() {
    let factory: lily_server::BackendFactory = Box::new(|_, _| Err(anyhow::anyhow!("no weights here")));
    let s = TestServer::start(config(), factory).await;
    let server = s.server.unwrap();
    let error = server.wait_ready().await.unwrap_err();
    assert!(format!("{error:#}").contains("no weights here"), "{error:#}");
    let error = tokio::time::timeout(std::time::Duration::from_secs(10), server.wait())
        .await
        .expect("stops")
        .unwrap_err();
    assert!(format!("{error:#}").contains("no weights here"));
}
