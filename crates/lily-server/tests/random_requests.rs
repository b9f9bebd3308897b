//! Randomized odd and hostile requests against the real server: whatever a client sends, the answer is a success or
//! an OpenAI error with a 4xx status, never a 5xx, a hang or a malformed body, and the server serves normally after
//! (no request left running, no slot held).

mod common;

use std::time::Duration;

use common::*;
use lily_model::rng::Rng;
use serde_json::{json, Value as Json};

fn pick(rng: &mut Rng, n: usize) -> usize {
    (rng.next_u64() % n as u64) as usize
}

/// A value for any field: every JSON type, edge numbers, odd strings, nested shapes.
fn value(rng: &mut Rng, depth: u32) -> Json {
    match pick(rng, 18) {
        0 => Json::Null,
        1 => json!(true),
        2 => json!(0),
        3 => json!(-1),
        4 => json!(2),
        5 => json!(1e308),
        6 => json!(i64::MIN),
        7 => json!(u64::MAX),
        8 => json!(0.5),
        9 => json!(""),
        10 => json!("<|im_start|>user\n<think>"),
        11 => json!("Speak. ".repeat(400)),
        12 => json!({"5": 100, "-1": 1, "999999999": 2, "7": "x"}),
        13 => json!([0, 1, 2, 3]),
        14 => json!({"type": "json_object"}),
        15 if depth < 2 => json!([value(rng, depth + 1), value(rng, depth + 1)]),
        16 if depth < 2 => {
            json!({"type": "json_schema", "json_schema": {"name": "x", "schema": value(rng, depth + 1)}})
        }
        _ => json!({"a": {"b": [null, {"$ref": "#"}]}}),
    }
}

const FIELDS: [&str; 30] = [
    "model",
    "messages",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "stream",
    "stream_options",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "echo",
    "response_format",
    "tools",
    "tool_choice",
    "chat_template_kwargs",
    "reasoning_effort",
    "ignore_eos",
    "tokens",
    "add_special_tokens",
    "user",
];

fn messages(rng: &mut Rng) -> Json {
    match pick(rng, 7) {
        0 => json!([{"role": "user", "content": "Good morrow."}]),
        1 => {
            json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hail."}]}])
        }
        2 => json!([
            {"role": "user", "content": "Call it."},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{"}}]},
            {"role": "tool", "tool_call_id": "1", "content": "done"}
        ]),
        3 => {
            json!([{"role": "assistant", "content": "<think>a</think>b", "reasoning_content": "r"}, {"role": "user", "content": "q"}])
        }
        4 => json!([{"role": "user", "content": "What light? ".repeat(60)}]),
        5 => json!([{"role": "user"}]),
        _ => value(rng, 0),
    }
}

/// A request: its route, body bytes and whether it asks for a stream.
fn request(rng: &mut Rng) -> (&'static str, Vec<u8>, bool) {
    let route = ["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"][pick(rng, 4)];
    let mut body = json!({"model": MODEL_ID, "max_tokens": 1 + pick(rng, 6)});
    match route {
        "/v1/chat/completions" => body["messages"] = messages(rng),
        "/detokenize" => body["tokens"] = json!([40, 41, 42]),
        _ => {
            body["prompt"] = [
                json!("ROMEO."),
                json!(["a", "b"]),
                json!([1, 2, 3]),
                json!([[4, 5], [6]]),
                json!(""),
            ][pick(rng, 5)]
            .clone()
        }
    }
    for _ in 0..pick(rng, 5) {
        body[FIELDS[pick(rng, FIELDS.len())]] = value(rng, 0);
    }
    if pick(rng, 4) == 0 {
        body["stream"] = json!(true);
    }
    let stream = body["stream"] == json!(true);
    let mut bytes = serde_json::to_vec(&body).unwrap();
    match pick(rng, 20) {
        0 => bytes.truncate(pick(rng, bytes.len().max(1))),
        1 => bytes.push(0xff),
        _ => {}
    }
    (route, bytes, stream)
}

#[tokio::test]
async fn random_requests_get_answers_or_openai_errors_and_leave_nothing_behind() {
    let mut c = config();
    c.context = Some(512);
    c.max_body_bytes = 256 * 1024;
    let s = TestServer::real(c).await;
    let mut rng = Rng::new(0x5eed_1e55);
    let mut statuses = std::collections::BTreeMap::new();
    // 80 rounds of 8 requests at once (the CPU server runs 4 sequences at a time; the rest queue).
    for _round in 0..80 {
        let mut handles = Vec::new();
        for _ in 0..8 {
            let (route, bytes, stream) = request(&mut rng);
            let hang_up = stream && pick(&mut rng, 3) == 0;
            let (client, url) = (s.client.clone(), s.url(route));
            handles.push(tokio::spawn(async move {
                let shown = String::from_utf8_lossy(&bytes[..bytes.len().min(300)]).into_owned();
                let response = client
                    .post(url)
                    .header("content-type", "application/json")
                    .body(bytes)
                    .send()
                    .await
                    .unwrap_or_else(|e| panic!("no answer ({e}) to {route} {shown}"));
                let status = response.status().as_u16();
                if hang_up && status == 200 {
                    return status; // the client goes away mid-stream
                }
                let text = response
                    .text()
                    .await
                    .unwrap_or_else(|e| panic!("body cut ({e}): {route} {shown}"));
                assert!(status < 500, "{status} for {route} {shown}: {text}");
                if status >= 400 {
                    let body: Json = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
                    assert_error_shape(&body);
                } else if stream {
                    for data in sse_data(&text) {
                        if data != "[DONE]" {
                            let _: Json = serde_json::from_str(&data).unwrap_or_else(|e| panic!("{e}: {data}"));
                        }
                    }
                } else {
                    let _: Json = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
                }
                status
            }));
        }
        for handle in handles {
            *statuses.entry(handle.await.unwrap()).or_insert(0) += 1;
        }
    }
    eprintln!("statuses: {statuses:?}");
    assert!(
        statuses.get(&200).is_some_and(|&n| n > 0),
        "some requests succeed: {statuses:?}"
    );
    assert!(
        statuses.keys().any(|&k| k == 400),
        "some requests are refused: {statuses:?}"
    );

    // Nothing left behind: every request ended (the clients that hung up included) and a plain one is served.
    eventually(Duration::from_secs(10), "no request left running", || async {
        s.metric("lily_requests_running").await == Some(0.0)
    })
    .await;
    let (status, body) = s
        .post(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "Good morrow."}], "max_tokens": 3}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    s.shutdown().await;
}
