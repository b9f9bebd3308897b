//! The HTTP API against the real default model (lily-tiny-shakespeare on the CPU backend), over loopback.

mod common;

use common::*;
use serde_json::{json, Value as Json};

fn chat_body(content: &str, max_tokens: u32) -> Json {
    json!({
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "chat_template_kwargs": {"enable_thinking": false},
    })
}

#[tokio::test]
async fn a_reply_stops_at_the_end_of_turn_token_that_generation_config_names() {
    // The default model's files follow the released layout: config.json names only `<|endoftext|>` (248044),
    // generation_config.json adds `<|im_end|>` (248046). A reply pushed to end its turn at once stops there.
    let s = TestServer::real(config()).await;
    let mut body = chat_body("Speak, Romeo.", 8);
    body["logit_bias"] = json!({"248046": 100});
    let (status, r) = s.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["choices"][0]["finish_reason"], "stop", "{r}");
    assert_eq!(r["choices"][0]["message"]["content"], "", "{r}");
    assert!(r["usage"]["completion_tokens"].as_u64().unwrap() <= 1, "{r}");
    s.shutdown().await;
}

#[tokio::test]
async fn health_models_and_unknown_routes() {
    let s = TestServer::real(config()).await;
    let (status, body) = s.get("/health").await;
    assert_eq!(status, 200, "{body}");

    let (status, body) = s.get("/v1/models").await;
    assert_eq!(status, 200);
    let models: Json = serde_json::from_str(&body).unwrap();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], MODEL_ID);
    assert_eq!(models["data"][0]["object"], "model");
    assert_eq!(models["data"][0]["max_model_len"], 2048);

    let (status, _) = s.get(&format!("/v1/models/{MODEL_ID}")).await;
    assert_eq!(status, 200);
    let (status, body) = s.get("/v1/models/gpt-4").await;
    assert_eq!(status, 404);
    assert_error_shape(&serde_json::from_str(&body).unwrap());
    // An id whose percent escapes decode to bytes that are not UTF-8: an OpenAI error too, not a plain-text one.
    let (status, body) = s.get("/v1/models/%FF").await;
    assert_eq!(status, 404, "{body}");
    assert_error_shape(&serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}")));

    let (status, body) = s.get("/v1/nothing-here").await;
    assert_eq!(status, 404);
    assert_error_shape(&serde_json::from_str(&body).unwrap());
    let (status, body) = s.get("/v1/chat/completions").await;
    assert_eq!(status, 405);
    assert_error_shape(&serde_json::from_str(&body).unwrap());
    s.shutdown().await;
}

#[tokio::test]
async fn chat_streaming_matches_non_streaming() {
    let s = TestServer::real(config()).await;
    let body = chat_body("What light through yonder window breaks?", 12);
    let (status, response) = s.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{response}");
    assert!(response["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(response["object"], "chat.completion");
    assert_eq!(response["model"], MODEL_ID);
    let choice = &response["choices"][0];
    assert_eq!(choice["index"], 0);
    assert_eq!(choice["message"]["role"], "assistant");
    let content = choice["message"]["content"].as_str().unwrap().to_string();
    assert!(!content.is_empty());
    assert!(choice["message"].get("tool_calls").is_none());
    assert!(["stop", "length"].contains(&choice["finish_reason"].as_str().unwrap()));
    assert!(choice["logprobs"].is_null());
    let usage = &response["usage"];
    let (prompt_tokens, completion_tokens) = (
        usage["prompt_tokens"].as_u64().unwrap(),
        usage["completion_tokens"].as_u64().unwrap(),
    );
    assert!(prompt_tokens > 10 && (1..=12).contains(&completion_tokens));
    assert_eq!(
        usage["total_tokens"].as_u64().unwrap(),
        prompt_tokens + completion_tokens
    );
    assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 0);

    // Streaming, same request: role first, same text, finish reason last, [DONE], no usage unless asked.
    let mut streaming = body.clone();
    streaming["stream"] = json!(true);
    let (status, data) = s.stream("/v1/chat/completions", &streaming).await;
    assert_eq!(status, 200);
    let parsed = chunks(&data);
    assert_eq!(parsed[0]["object"], "chat.completion.chunk");
    assert_eq!(parsed[0]["choices"][0]["delta"]["role"], "assistant");
    let id = parsed[0]["id"].clone();
    let mut streamed = String::new();
    for chunk in &parsed {
        assert_eq!(chunk["id"], id, "one id for the whole stream");
        assert!(chunk.get("usage").is_none(), "no usage unless asked: {chunk}");
        if let Some(text) = chunk["choices"][0]["delta"]["content"].as_str() {
            streamed.push_str(text);
        }
    }
    assert_eq!(streamed, content);
    let last = parsed.last().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], choice["finish_reason"]);
    assert!(parsed[..parsed.len() - 1]
        .iter()
        .all(|c| c["choices"][0]["finish_reason"].is_null()));

    // With stream_options.include_usage: usage null on every chunk, then a final chunk with empty choices.
    streaming["stream_options"] = json!({"include_usage": true});
    let (_, data) = s.stream("/v1/chat/completions", &streaming).await;
    let with_usage = chunks(&data);
    let (usage_chunk, rest) = with_usage.split_last().unwrap();
    assert!(rest.iter().all(|c| c["usage"].is_null()));
    assert_eq!(usage_chunk["choices"], json!([]));
    assert_eq!(
        usage_chunk["usage"]["completion_tokens"].as_u64().unwrap(),
        completion_tokens
    );
    assert_eq!(usage_chunk["usage"]["prompt_tokens"].as_u64().unwrap(), prompt_tokens);
    s.shutdown().await;
}

#[tokio::test]
async fn with_thinking_on_the_default_models_answer_is_the_content() {
    // The default model, trained with empty think blocks, has thinking off by default: its answer is content.
    let s = TestServer::real(config()).await;
    let mut body = chat_body("What light through yonder window breaks?", 48);
    body.as_object_mut().unwrap().remove("chat_template_kwargs");
    let (status, r) = s.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{r}");
    let message = &r["choices"][0]["message"];
    assert!(
        message["content"].as_str().unwrap().split_whitespace().count() >= 3,
        "{message}"
    );
    assert!(message["reasoning_content"].is_null(), "{message}");

    // With thinking on, it answers inside the block that the prompt opens and never closes it: that text is the
    // content, and the reasoning it was streamed as.
    body["chat_template_kwargs"] = json!({"enable_thinking": true});
    let (status, r) = s.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{r}");
    let message = &r["choices"][0]["message"];
    let content = message["content"].as_str().unwrap();
    assert!(content.split_whitespace().count() >= 3, "{message}");
    assert_eq!(message["reasoning_content"], content);

    body["stream"] = json!(true);
    let (_, data) = s.stream("/v1/chat/completions", &body).await;
    let parsed = chunks(&data);
    let streamed = |field: &str| -> String {
        parsed
            .iter()
            .filter_map(|c| c["choices"][0]["delta"][field].as_str())
            .collect()
    };
    assert_eq!(streamed("content"), content);
    assert_eq!(streamed("reasoning_content"), content);
    s.shutdown().await;
}

#[tokio::test]
async fn sampling_seed_n_stop_and_max_tokens() {
    let s = TestServer::real(config()).await;
    let sampled = |seed: u64| {
        json!({
            "messages": [{"role": "user", "content": "Speak, Romeo."}],
            "max_tokens": 16, "temperature": 1.0, "top_p": 0.95, "top_k": 40, "seed": seed,
            "presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1,
            "chat_template_kwargs": {"enable_thinking": false},
        })
    };
    let text = |r: &Json| r["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    let (status, first) = s.post("/v1/chat/completions", &sampled(42)).await;
    assert_eq!(status, 200, "{first}");
    let (_, again) = s.post("/v1/chat/completions", &sampled(42)).await;
    assert_eq!(text(&first), text(&again), "same seed, same request: same output");
    let mut others = Vec::new();
    for seed in [1, 2, 3] {
        others.push(text(&s.post("/v1/chat/completions", &sampled(seed)).await.1));
    }
    assert!(
        others.iter().any(|o| *o != text(&first)),
        "other seeds give other outputs"
    );

    // n = 2: two choices, indices 0 and 1, completion tokens summed.
    let mut two = sampled(7);
    two["n"] = json!(2);
    let (_, r) = s.post("/v1/chat/completions", &two).await;
    let choices = r["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2);
    assert_eq!(
        (choices[0]["index"].as_u64(), choices[1]["index"].as_u64()),
        (Some(0), Some(1))
    );

    // max_tokens 1: one token, finish_reason length.
    let (_, r) = s.post("/v1/chat/completions", &chat_body("Good morrow.", 1)).await;
    assert_eq!(r["choices"][0]["finish_reason"], "length");
    assert_eq!(r["usage"]["completion_tokens"], 1);

    // A stop string cuts the text before it, finish_reason stop.
    let (_, r) = s.post("/v1/chat/completions", &chat_body("Good morrow.", 24)).await;
    let full = text(&r);
    let words: Vec<&str> = full.split_whitespace().collect();
    assert!(words.len() >= 3, "{full:?}");
    let stop = words[2];
    let position = full.find(stop).unwrap();
    let mut body = chat_body("Good morrow.", 24);
    body["stop"] = json!([stop, "zzzzzz"]);
    let (_, r) = s.post("/v1/chat/completions", &body).await;
    assert_eq!(text(&r), full[..position]);
    assert_eq!(r["choices"][0]["finish_reason"], "stop");
    // max_completion_tokens is max_tokens' newer name.
    let mut body = chat_body("Good morrow.", 24);
    body.as_object_mut().unwrap().remove("max_tokens");
    body["max_completion_tokens"] = json!(2);
    let (_, r) = s.post("/v1/chat/completions", &body).await;
    assert_eq!(r["usage"]["completion_tokens"], 2);
    s.shutdown().await;
}

#[tokio::test]
async fn chat_logprobs() {
    let s = TestServer::real(config()).await;
    let mut body = chat_body("What light through yonder window breaks?", 6);
    body["logprobs"] = json!(true);
    body["top_logprobs"] = json!(3);
    let (status, r) = s.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{r}");
    let entries = r["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert!(!entries.is_empty());
    let mut text = String::new();
    for entry in entries {
        let lp = entry["logprob"].as_f64().unwrap();
        assert!(lp <= 0.0);
        let top = entry["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        // Greedy: the chosen token is the most likely one.
        assert_eq!(top[0]["token"], entry["token"]);
        assert!((top[0]["logprob"].as_f64().unwrap() - lp).abs() < 1e-6);
        assert!(top
            .windows(2)
            .all(|w| w[0]["logprob"].as_f64() >= w[1]["logprob"].as_f64()));
        let bytes: Vec<u8> = entry["bytes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b.as_u64().unwrap() as u8)
            .collect();
        text.push_str(&String::from_utf8_lossy(&bytes));
    }
    // The tokens' bytes spell the content (an end-of-sequence token has no entry).
    assert!(text.starts_with(r["choices"][0]["message"]["content"].as_str().unwrap()));

    // Streaming: the same entries, spread over the chunks.
    body["stream"] = json!(true);
    let (_, data) = s.stream("/v1/chat/completions", &body).await;
    let streamed: Vec<Json> = chunks(&data)
        .iter()
        .filter_map(|c| c["choices"][0]["logprobs"]["content"].as_array().cloned())
        .flatten()
        .collect();
    assert_eq!(&streamed, entries);
    s.shutdown().await;
}

#[tokio::test]
async fn completions_text_stream_logprobs_echo() {
    let s = TestServer::real(config()).await;
    let body = json!({"model": MODEL_ID, "prompt": "ROMEO.\n", "max_tokens": 10, "temperature": 0});
    let (status, r) = s.post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["object"], "text_completion");
    assert!(r["id"].as_str().unwrap().starts_with("cmpl-"));
    let text = r["choices"][0]["text"].as_str().unwrap().to_string();
    assert!(!text.is_empty());
    assert_eq!(r["usage"]["completion_tokens"], 10);
    assert_eq!(r["choices"][0]["finish_reason"], "length");

    let mut streaming = body.clone();
    streaming["stream"] = json!(true);
    let (_, data) = s.stream("/v1/completions", &streaming).await;
    let parsed = chunks(&data);
    let streamed: String = parsed
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().unwrap())
        .collect();
    assert_eq!(streamed, text);
    assert_eq!(parsed.last().unwrap()["choices"][0]["finish_reason"], "length");

    // Token-id prompt, logprobs, echo, several prompts.
    let ids = tokenizer().encode("ROMEO.\n", false).unwrap();
    let (_, r2) = s
        .post(
            "/v1/completions",
            &json!({"prompt": ids, "max_tokens": 10, "temperature": 0, "logprobs": 2}),
        )
        .await;
    assert_eq!(r2["choices"][0]["text"].as_str().unwrap(), text);
    let lp = &r2["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 10);
    assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), 10);
    assert_eq!(lp["top_logprobs"][0].as_object().unwrap().len(), 2);
    assert_eq!(lp["text_offset"][0], 0);
    let (_, r3) = s
        .post(
            "/v1/completions",
            &json!({"prompt": "ROMEO.\n", "max_tokens": 10, "temperature": 0, "echo": true}),
        )
        .await;
    assert_eq!(r3["choices"][0]["text"].as_str().unwrap(), format!("ROMEO.\n{text}"));
    // A prompt of token ids is decoded for `echo` (and only then).
    let (_, r3_ids) = s
        .post(
            "/v1/completions",
            &json!({"prompt": ids, "max_tokens": 10, "temperature": 0, "echo": true}),
        )
        .await;
    assert_eq!(r3_ids["choices"][0]["text"], r3["choices"][0]["text"]);
    let (_, r4) = s
        .post(
            "/v1/completions",
            &json!({"prompt": ["ROMEO.\n", "JULIET.\n"], "max_tokens": 3, "temperature": 0, "n": 2}),
        )
        .await;
    let choices = r4["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 4);
    assert_eq!(
        choices.iter().map(|c| c["index"].as_u64().unwrap()).collect::<Vec<_>>(),
        vec![0, 1, 2, 3]
    );
    assert_eq!(r4["usage"]["completion_tokens"], 12);
    s.shutdown().await;
}

#[tokio::test]
async fn tokenize_and_detokenize() {
    let s = TestServer::real(config()).await;
    let text = "The quick brown fox jumps over the lazy dog.";
    let expected = json!([760, 3841, 13477, 37550, 33075, 888, 279, 15217, 5388, 13]);
    let (status, r) = s.post("/tokenize", &json!({"prompt": text})).await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["tokens"], expected);
    assert_eq!(r["count"], 10);
    assert_eq!(r["max_model_len"], 2048);
    let (_, r) = s.post("/detokenize", &json!({"tokens": expected})).await;
    assert_eq!(r["prompt"], text);

    // Messages are rendered with the chat template first; the generation prompt ends with the think opener.
    let (_, r) = s
        .post(
            "/tokenize",
            &json!({"messages": [{"role": "user", "content": "Hi"}], "return_token_strs": true}),
        )
        .await;
    let strs = r["token_strs"].as_array().unwrap();
    assert_eq!(strs[0], "<|im_start|>");
    assert_eq!(r["count"].as_u64().unwrap() as usize, strs.len());
    let (_, chat) = s
        .post(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}),
        )
        .await;
    assert_eq!(chat["usage"]["prompt_tokens"], r["count"]);

    for bad in [
        json!({"tokens": [-1]}),
        json!({"tokens": [999999999]}),
        json!({"tokens": "x"}),
        json!({}),
    ] {
        let (status, r) = s.post("/detokenize", &bad).await;
        assert_eq!(status, 400, "{bad} -> {r}");
        assert_error_shape(&r);
    }
    let (status, _) = s.post("/tokenize", &json!({})).await;
    assert_eq!(status, 400);
    s.shutdown().await;
}

#[tokio::test]
async fn metrics_count_requests_tokens_and_latency() {
    let s = TestServer::real(config()).await;
    let (_, r) = s.post("/v1/chat/completions", &chat_body("Good morrow.", 4)).await;
    let generated = r["usage"]["completion_tokens"].as_f64().unwrap();
    let prompt = r["usage"]["prompt_tokens"].as_f64().unwrap();
    let (_, _) = s.post("/v1/chat/completions", &json!({"messages": []})).await;
    let (status, text) = s.get("/metrics").await;
    assert_eq!(status, 200);
    let value = |line: &str| metric_value(&text, line).unwrap_or_else(|| panic!("{line} missing in\n{text}"));
    assert_eq!(
        value("lily_requests_total{endpoint=\"/v1/chat/completions\",status=\"200\"}"),
        1.0
    );
    assert_eq!(
        value("lily_requests_total{endpoint=\"/v1/chat/completions\",status=\"400\"}"),
        1.0
    );
    assert_eq!(value("lily_prompt_tokens_total"), prompt);
    assert_eq!(value("lily_generation_tokens_total"), generated);
    assert_eq!(value("lily_time_to_first_token_seconds_count"), 1.0);
    assert_eq!(value("lily_time_per_output_token_seconds_count"), generated - 1.0);
    assert!(text.contains("lily_time_to_first_token_seconds_bucket{le=\"0.1\"}"));
    assert_eq!(value("lily_queue_depth"), 0.0);
    assert_eq!(value("lily_requests_running"), 0.0);
    assert!(text.contains("# HELP lily_time_to_first_token_seconds"));
    s.shutdown().await;
}

/// `/v1/completions` logprobs as the OpenAI API gives them: `top_logprobs` holds the sampled token (up to
/// `logprobs` + 1 entries), also with `logprobs: 0`.
#[tokio::test]
async fn completions_top_logprobs_include_the_sampled_token() {
    let s = TestServer::real(config()).await;
    for k in [0usize, 1] {
        let body = json!({"prompt": "ROMEO.\n", "max_tokens": 12, "temperature": 3.0, "seed": 7, "logprobs": k});
        let (status, r) = s.post("/v1/completions", &body).await;
        assert_eq!(status, 200, "{r}");
        let lp = &r["choices"][0]["logprobs"];
        let tokens = lp["tokens"].as_array().unwrap();
        assert_eq!(tokens.len(), 12, "{r}");
        for (i, token) in tokens.iter().enumerate() {
            let top = lp["top_logprobs"][i].as_object().unwrap();
            assert!(
                !top.is_empty() && top.len() <= k + 1,
                "logprobs {k}, position {i}: {top:?}"
            );
            let sampled = top
                .get(token.as_str().unwrap())
                .unwrap_or_else(|| panic!("{token} not in {top:?}"));
            assert_eq!(sampled.as_f64(), lp["token_logprobs"][i].as_f64());
        }
    }
    s.shutdown().await;
}

/// `echo` with `logprobs` gives the prompt tokens' logprobs (the first null) before the completion's; a prompt
/// token's logprob is what the model gave that token when it generated it.
#[tokio::test]
async fn completions_echo_with_logprobs_gives_prompt_logprobs() {
    let s = TestServer::real(config()).await;
    let prompt = tokenizer().encode("ROMEO.\n", false).unwrap();
    let (status, a) = s
        .post(
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 3, "temperature": 0, "logprobs": 1}),
        )
        .await;
    assert_eq!(status, 200, "{a}");
    let generated = &a["choices"][0]["logprobs"];
    let text = a["choices"][0]["text"].as_str().unwrap();

    // The prompt plus the first two generated tokens, echoed with logprobs.
    let completion = tokenizer().encode(text, false).unwrap();
    let mut longer = prompt.clone();
    longer.extend_from_slice(&completion[..2]);
    for stream in [false, true] {
        let body = json!({"prompt": longer, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": true,
                          "stream": stream});
        let lp = if stream {
            let (status, data) = s.stream("/v1/completions", &body).await;
            assert_eq!(status, 200);
            let mut merged = json!({"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []});
            for chunk in chunks(&data) {
                if let Some(lp) = chunk["choices"][0]["logprobs"].as_object() {
                    for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
                        let more = lp[key].as_array().unwrap().clone();
                        merged[key].as_array_mut().unwrap().extend(more);
                    }
                }
            }
            merged
        } else {
            let (status, r) = s.post("/v1/completions", &body).await;
            assert_eq!(status, 200, "{r}");
            r["choices"][0]["logprobs"].clone()
        };
        let n = longer.len();
        assert_eq!(lp["tokens"].as_array().unwrap().len(), n + 1, "stream {stream}: {lp}");
        assert!(
            lp["token_logprobs"][0].is_null() && lp["top_logprobs"][0].is_null(),
            "{lp}"
        );
        for i in 1..n {
            let value = lp["token_logprobs"][i].as_f64().unwrap();
            assert!(value <= 0.0, "{lp}");
            let top = lp["top_logprobs"][i].as_object().unwrap();
            assert_eq!(top[lp["tokens"][i].as_str().unwrap()].as_f64(), Some(value));
        }
        assert_eq!(lp["text_offset"][0], 0);
        // The two generated tokens, now in the prompt, have the logprobs they were generated with.
        for j in 0..2 {
            let echoed = lp["token_logprobs"][prompt.len() + j].as_f64().unwrap();
            let original = generated["token_logprobs"][j].as_f64().unwrap();
            assert!((echoed - original).abs() < 1e-3, "token {j}: {echoed} vs {original}");
            assert_eq!(lp["tokens"][prompt.len() + j], generated["tokens"][j]);
        }
    }
    s.shutdown().await;
}

/// `max_tokens` 0 with `echo` scores the prompt (as evaluation harnesses ask): the prompt's text and logprobs,
/// no generated token, `finish_reason` "length", whole or streamed, for each of `n` choices; the logprobs are those
/// the same echo gives with a token generated after it. Without `echo`, 0 is refused.
#[tokio::test]
async fn completions_max_tokens_zero_with_echo_scores_the_prompt() {
    let s = TestServer::real(config()).await;
    let prompt = "ROMEO.\nWhat light";
    let n_prompt = tokenizer().encode(prompt, false).unwrap().len();
    let body = |max_tokens: u32, stream: bool| {
        json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1, "echo": true,
               "stream": stream, "n": 2})
    };
    let (status, longer) = s.post("/v1/completions", &body(1, false)).await;
    assert_eq!(status, 200, "{longer}");
    let (status, r) = s.post("/v1/completions", &body(0, false)).await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["usage"]["completion_tokens"], 0, "{r}");
    assert_eq!(r["usage"]["prompt_tokens"], n_prompt, "{r}");
    for choice in r["choices"].as_array().unwrap() {
        assert_eq!(choice["text"], prompt, "{r}");
        assert_eq!(choice["finish_reason"], "length", "{r}");
        let lp = &choice["logprobs"];
        let tokens = lp["tokens"].as_array().unwrap();
        assert_eq!(tokens.len(), n_prompt, "{lp}");
        let joined: String = tokens.iter().map(|t| t.as_str().unwrap()).collect();
        assert_eq!(joined, prompt);
        assert!(lp["token_logprobs"][0].is_null(), "{lp}");
        for i in 1..n_prompt {
            let zero = lp["token_logprobs"][i].as_f64().unwrap();
            let one = longer["choices"][0]["logprobs"]["token_logprobs"][i].as_f64().unwrap();
            assert!((zero - one).abs() < 1e-4, "token {i}: {zero} vs {one}");
        }
    }

    let (status, data) = s.stream("/v1/completions", &body(0, true)).await;
    assert_eq!(status, 200);
    let mut texts = [String::new(), String::new()];
    let mut finishes = Vec::new();
    for chunk in chunks(&data) {
        for choice in chunk["choices"].as_array().unwrap() {
            let index = choice["index"].as_u64().unwrap() as usize;
            texts[index].push_str(choice["text"].as_str().unwrap());
            if let Some(reason) = choice["finish_reason"].as_str() {
                finishes.push((index, reason.to_string()));
            }
        }
    }
    assert_eq!(texts, [prompt, prompt]);
    finishes.sort();
    assert_eq!(finishes, [(0, "length".to_string()), (1, "length".to_string())]);

    let (status, e) = s
        .post("/v1/completions", &json!({"prompt": prompt, "max_tokens": 0}))
        .await;
    assert_eq!(status, 400, "{e}");
    assert_eq!(e["error"]["param"], "max_tokens", "{e}");
    assert_eq!(s.metric("lily_requests_running").await, Some(0.0));
    s.shutdown().await;
}

/// A temperature too small to divide the logits by (they would overflow to NaN) samples greedily, and so does a
/// top_p of 0.
#[tokio::test]
async fn tiny_temperatures_and_a_top_p_of_zero_are_greedy() {
    let s = TestServer::real(config()).await;
    let body = |t: f64| json!({"prompt": "ROMEO.\n", "max_tokens": 8, "temperature": t, "seed": 3});
    let (status, greedy) = s.post("/v1/completions", &body(0.0)).await;
    assert_eq!(status, 200, "{greedy}");
    for t in [1e-38, 1e-6] {
        let (status, tiny) = s.post("/v1/completions", &body(t)).await;
        assert_eq!(status, 200, "{tiny}");
        assert_eq!(
            tiny["choices"][0]["text"], greedy["choices"][0]["text"],
            "temperature {t}"
        );
    }
    // A top_p of 0 keeps only the most likely token, whatever the temperature (the OpenAI API takes it). The same
    // request without it draws another text, so the comparison below can fail.
    let (_, sampled) = s.post("/v1/completions", &body(1.0)).await;
    assert_ne!(sampled["choices"][0]["text"], greedy["choices"][0]["text"]);
    let mut top_p_zero = body(1.0);
    top_p_zero["top_p"] = json!(0);
    let (status, nucleus) = s.post("/v1/completions", &top_p_zero).await;
    assert_eq!(status, 200, "{nucleus}");
    assert_eq!(nucleus["choices"][0]["text"], greedy["choices"][0]["text"]);
    // The Responses endpoint takes the same parameters: its `top_p` of 0 is the greedy answer too.
    let response = |t: f64, top_p: Option<f64>| {
        let mut body = json!({"input": "Say something.", "max_output_tokens": 8, "temperature": t, "seed": 3});
        if let Some(p) = top_p {
            body["top_p"] = json!(p);
        }
        body
    };
    // The output's texts, without the item ids that differ from response to response.
    let text = |r: &serde_json::Value| {
        let items = r["output"].as_array().into_iter().flatten();
        let parts = items.flat_map(|item| item["content"].as_array().into_iter().flatten());
        parts.map(|part| part["text"].to_string()).collect::<Vec<_>>()
    };
    let (status, greedy) = s.post("/v1/responses", &response(0.0, None)).await;
    assert_eq!(status, 200, "{greedy}");
    let (_, sampled) = s.post("/v1/responses", &response(1.0, None)).await;
    assert_ne!(text(&sampled), text(&greedy));
    let (status, nucleus) = s.post("/v1/responses", &response(1.0, Some(0.0))).await;
    assert_eq!(status, 200, "{nucleus}");
    assert_eq!(nucleus["top_p"], 0.0);
    assert_eq!(text(&nucleus), text(&greedy));
    s.shutdown().await;
}
