//! The queue and the engine thread: cancellation on disconnect, 429 on a full queue, graceful shutdown, and a
//! bounded load test.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value as Json};

fn long_stream(max_tokens: usize) -> Json {
    json!({"messages": [{"role": "user", "content": "Speak on."}], "max_tokens": max_tokens, "stream": true,
           "ignore_eos": true, "chat_template_kwargs": {"enable_thinking": false}})
}

/// Opens a stream and reads until `chunks` data lines have arrived; returns the open response.
async fn open_stream(s: &TestServer, body: &Json, chunks: usize) -> reqwest::Response {
    let response = s
        .client
        .post(s.url("/v1/chat/completions"))
        .json(body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let mut response = response;
    let mut seen = 0;
    while seen < chunks {
        let bytes = response.chunk().await.unwrap().expect("stream open");
        seen += String::from_utf8_lossy(&bytes).matches("data: ").count();
    }
    response
}

#[tokio::test]
async fn disconnect_cancels_within_a_decode_step() {
    let mut c = config();
    c.context = Some(200_000);
    let script = Script::endless(Duration::from_millis(5));
    let decodes = script.decodes.clone();
    let s = TestServer::fake(c, script).await;
    let response = open_stream(&s, &long_stream(100_000), 5).await;
    drop(response);
    eventually(Duration::from_secs(5), "the generation is cancelled", || async {
        s.metric("lily_requests_cancelled_total").await == Some(1.0)
    })
    .await;
    let after_cancel = decodes.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        decodes.load(Ordering::SeqCst) <= after_cancel + 1,
        "no decoding after the cancel"
    );
    assert_eq!(s.metric("lily_requests_running").await, Some(0.0));

    // A non-streaming request whose client gives up is cancelled too.
    let before = decodes.load(Ordering::SeqCst);
    let body = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 100_000, "ignore_eos": true});
    let result = s
        .client
        .post(s.url("/v1/chat/completions"))
        .timeout(Duration::from_millis(300))
        .json(&body)
        .send()
        .await;
    assert!(result.is_err(), "the client timed out");
    eventually(
        Duration::from_secs(5),
        "the non-streaming generation is cancelled",
        || async { s.metric("lily_requests_cancelled_total").await == Some(2.0) },
    )
    .await;
    assert!(
        decodes.load(Ordering::SeqCst) - before < 200,
        "stopped soon after the disconnect"
    );

    // The server answers the next request.
    let (status, r) = s
        .post(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}),
        )
        .await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["usage"]["completion_tokens"], 3);
    s.shutdown().await;
}

#[tokio::test]
async fn disconnect_mid_stream_with_the_real_model() {
    let s = TestServer::real(config()).await;
    let response = open_stream(&s, &long_stream(2000), 4).await;
    drop(response);
    eventually(Duration::from_secs(10), "the generation is cancelled", || async {
        s.metric("lily_requests_cancelled_total").await == Some(1.0)
    })
    .await;
    let generated = s.metric("lily_generation_tokens_total").await.unwrap();
    assert!(generated < 1000.0, "stopped early: {generated} tokens");
    let (status, r) = s
        .post(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "Good morrow."}], "max_tokens": 4}),
        )
        .await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(s.get("/health").await.0, 200);
    s.shutdown().await;
}

#[tokio::test]
async fn full_queue_answers_429_with_retry_after() {
    let mut c = config();
    c.max_queue = 1;
    c.context = Some(200_000);
    let s = Arc::new(TestServer::fake(c, Script::endless(Duration::from_millis(5))).await);
    // A runs, B waits in the queue (its one place), C is refused.
    let a = open_stream(&s, &long_stream(100_000), 2).await;
    let b = {
        let s = s.clone();
        tokio::spawn(async move {
            s.post(
                "/v1/chat/completions",
                &json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}),
            )
            .await
        })
    };
    eventually(Duration::from_secs(5), "B is queued", || async {
        s.metric("lily_queue_depth").await == Some(1.0)
    })
    .await;
    let response = s
        .client
        .post(s.url("/v1/chat/completions"))
        .json(&long_stream(3))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 429);
    assert_eq!(response.headers()["retry-after"], "1");
    let body: Json = response.json().await.unwrap();
    assert_error_shape(&body);
    assert_eq!(body["error"]["type"], "rate_limit_error");
    assert_eq!(s.metric("lily_requests_rejected_total").await, Some(1.0));
    // A's client leaves; B runs and is answered.
    drop(a);
    let (status, r) = b.await.unwrap();
    assert_eq!(status, 200, "{r}");
    assert_eq!(s.metric("lily_queue_depth").await, Some(0.0));
    let s = Arc::into_inner(s).unwrap();
    s.shutdown().await;
}

#[tokio::test]
async fn graceful_shutdown_finishes_in_flight_requests() {
    let mut c = config();
    c.context = Some(200_000);
    let s = TestServer::fake(c, Script::endless(Duration::from_millis(5))).await;
    let mut response = open_stream(&s, &long_stream(120), 2).await;
    let server = s.server.as_ref().unwrap();
    server.shutdown();
    // New work is refused (the listener is closed, or the request is answered 503).
    eventually(Duration::from_secs(5), "new requests are refused", || async {
        match s.client.get(s.url("/health")).send().await {
            Err(_) => true,
            Ok(r) => r.status() == 503,
        }
    })
    .await;
    // The stream in flight runs to its end.
    let mut rest = String::new();
    while let Some(bytes) = response.chunk().await.unwrap() {
        rest.push_str(&String::from_utf8_lossy(&bytes));
    }
    let data = sse_data(&rest);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let last: Json = serde_json::from_str(&data[data.len() - 2]).unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    let server = s.server.unwrap();
    tokio::time::timeout(Duration::from_secs(10), server.wait())
        .await
        .expect("stops")
        .expect("cleanly");
}

#[tokio::test]
async fn shutdown_cancels_what_outlives_the_grace_period() {
    let mut c = config();
    c.context = Some(200_000);
    c.shutdown_timeout = Duration::from_millis(200);
    let s = TestServer::fake(c, Script::endless(Duration::from_millis(5))).await;
    let mut response = open_stream(&s, &long_stream(100_000), 2).await;
    let started = Instant::now();
    s.server.as_ref().unwrap().shutdown();
    let mut rest = String::new();
    while let Some(bytes) = response.chunk().await.unwrap() {
        rest.push_str(&String::from_utf8_lossy(&bytes));
    }
    let data = sse_data(&rest);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let error: Json = serde_json::from_str(&data[data.len() - 2]).unwrap();
    assert_error_shape(&error);
    assert!(started.elapsed() < Duration::from_secs(5));
    let server = s.server.unwrap();
    tokio::time::timeout(Duration::from_secs(10), server.wait())
        .await
        .expect("stops")
        .expect("cleanly");
}

/// 200 requests from 16 concurrent clients against the real model, with a queue shorter than the number of
/// clients so that some attempts are refused: every attempt is answered 200 with a well-formed body or refused
/// 429 with Retry-After (the client then retries, after 200 ms rather than the advised second, to keep the test
/// short), no request is lost, the metrics agree, and the server is healthy after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_test_200_requests_16_clients() {
    const REQUESTS: usize = 200;
    const CLIENTS: usize = 16;
    let mut c = config();
    c.max_queue = 8;
    let s = Arc::new(TestServer::real(c).await);
    let next = Arc::new(AtomicUsize::new(0));
    let (ok, refused) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let started = Instant::now();
    let mut clients = Vec::new();
    for _ in 0..CLIENTS {
        let (s, next, ok, refused) = (s.clone(), next.clone(), ok.clone(), refused.clone());
        clients.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                if i >= REQUESTS {
                    break;
                }
                let (path, body) = match i % 4 {
                    0 | 2 => (
                        "/v1/completions",
                        json!({"prompt": format!("ROMEO {i}."), "max_tokens": 2, "seed": i}),
                    ),
                    1 => (
                        "/v1/chat/completions",
                        json!({"messages": [{"role": "user", "content": format!("Hi {i}")}],
                                                          "max_tokens": 2, "stream": true}),
                    ),
                    _ => (
                        "/v1/chat/completions",
                        json!({"messages": [{"role": "user", "content": format!("Hi {i}")}],
                                                          "max_tokens": 2, "seed": i}),
                    ),
                };
                for attempt in 0.. {
                    assert!(attempt < 2000, "request {i} refused too often");
                    let response = s.client.post(s.url(path)).json(&body).send().await.expect("answered");
                    let status = response.status().as_u16();
                    let retry_after = response.headers().get("retry-after").cloned();
                    let text = response.text().await.expect("body");
                    match status {
                        200 if body.get("stream").is_some() => {
                            let data = sse_data(&text);
                            assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{text}");
                            let last: Json = serde_json::from_str(&data[data.len() - 2]).unwrap();
                            assert!(last["choices"][0]["finish_reason"].is_string(), "{text}");
                        }
                        200 => {
                            let r: Json = serde_json::from_str(&text).unwrap();
                            assert!(r["choices"][0]["finish_reason"].is_string(), "{text}");
                            assert!(r["usage"]["completion_tokens"].as_u64().unwrap() <= 2);
                        }
                        429 => {
                            assert_eq!(retry_after.unwrap(), "1");
                            assert_error_shape(&serde_json::from_str(&text).unwrap());
                            refused.fetch_add(1, Ordering::SeqCst);
                            tokio::time::sleep(Duration::from_millis(200)).await;
                            continue;
                        }
                        other => panic!("request {i}: unexpected status {other}: {text}"),
                    }
                    ok.fetch_add(1, Ordering::SeqCst);
                    break;
                }
            }
        }));
    }
    for client in clients {
        client.await.expect("client ran");
    }
    let (ok, refused) = (ok.load(Ordering::SeqCst), refused.load(Ordering::SeqCst));
    eprintln!(
        "load test: {ok} answered, {refused} attempts refused with 429, in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    assert_eq!(ok, REQUESTS, "every request answered");
    assert_eq!(s.get("/health").await.0, 200);
    let (_, metrics) = s.get("/metrics").await;
    let count = |endpoint: &str, status: u16| {
        metric_value(
            &metrics,
            &format!("lily_requests_total{{endpoint=\"{endpoint}\",status=\"{status}\"}}"),
        )
        .unwrap_or(0.0)
    };
    let served = count("/v1/chat/completions", 200) + count("/v1/completions", 200);
    let rejected = count("/v1/chat/completions", 429) + count("/v1/completions", 429);
    assert_eq!(served as usize, ok);
    assert_eq!(rejected as usize, refused);
    assert_eq!(
        metric_value(&metrics, "lily_requests_rejected_total"),
        Some(refused as f64)
    );
    assert_eq!(metric_value(&metrics, "lily_queue_depth"), Some(0.0));
    assert_eq!(metric_value(&metrics, "lily_requests_running"), Some(0.0));
    let (status, _) = s
        .post(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
        )
        .await;
    assert_eq!(status, 200);
    let s = Arc::into_inner(s).unwrap();
    s.shutdown().await;
}

/// A KV pool that holds two of four sequences whole (the real model on the CPU backend): the four run together,
/// granted context as they grow, the ones admitted last are preempted when the pool runs out and computed again,
/// and every greedy answer is the one the request gets alone.
#[tokio::test]
async fn a_pool_too_small_for_every_sequence_preempts_and_answers_as_alone() {
    let mut c = config();
    c.context = Some(1024);
    c.pool.max_seqs = Some(4);
    c.pool.kv_tokens = Some(512);
    c.engine.grant_ahead = 16;
    let s = Arc::new(TestServer::real(c).await);
    let body =
        |i: usize| json!({"prompt": format!("ROMEO {i}:"), "max_tokens": 200, "temperature": 0, "ignore_eos": true});
    let text = |reply: &Json| reply["choices"][0]["text"].as_str().expect("a text").to_string();
    let mut alone = Vec::new();
    for i in 0..4 {
        let (status, reply) = s.post("/v1/completions", &body(i)).await;
        assert_eq!(status, 200, "{reply}");
        assert_eq!(reply["usage"]["completion_tokens"], 200);
        alone.push(text(&reply));
    }
    assert_eq!(s.metric("lily_preemptions_total").await.unwrap_or(0.0), 0.0);
    let together: Vec<_> = (0..4)
        .map(|i| {
            let (s, body) = (s.clone(), body(i));
            tokio::spawn(async move { s.post("/v1/completions", &body).await })
        })
        .collect();
    for (i, handle) in together.into_iter().enumerate() {
        let (status, reply) = handle.await.unwrap();
        assert_eq!(status, 200, "{reply}");
        assert_eq!(reply["usage"]["completion_tokens"], 200);
        assert_eq!(text(&reply), alone[i], "request {i}");
    }
    assert!(s.metric("lily_preemptions_total").await.unwrap_or(0.0) > 0.0);
}
