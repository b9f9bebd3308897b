//! The prefix cache on the real default model (CPU backend) through the HTTP API: a multi-turn chat and requests
//! sharing a system prompt take their shared tokens from the cache (`usage.prompt_tokens_details.cached_tokens`,
//! the `/metrics` counters), and every greedy answer is token for token the answer of a server with the cache off.

mod common;

use common::TestServer;
use serde_json::{json, Value as Json};

/// A system prompt of a few hundred tokens, as an agent's instructions and tools would be.
fn system_prompt() -> String {
    (0..24)
        .map(|i| format!("Rule {i}: speak as the players of the court would, in measured verse."))
        .collect::<Vec<_>>()
        .join(" ")
}

async fn server(cache: bool) -> TestServer {
    let mut config = common::config();
    config.context = Some(4096);
    config.engine.prefix_cache = cache;
    // Snapshots every 256 tokens as well as where messages end.
    config.engine.snapshot_interval = 256;
    if !cache {
        config.pool.prefix_cache_bytes = Some(0);
    }
    TestServer::real(config).await
}

/// A greedy chat request without thinking; returns (content, prompt tokens, cached tokens).
async fn chat(server: &TestServer, messages: &[Json]) -> (String, u64, u64) {
    let body = json!({
        "model": common::MODEL_ID,
        "messages": messages,
        "max_tokens": 24,
        "temperature": 0,
        "chat_template_kwargs": {"enable_thinking": false},
    });
    let (status, reply) = server.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{reply}");
    let content = reply["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or("")
        .to_string();
    let usage = &reply["usage"];
    (
        content,
        usage["prompt_tokens"].as_u64().unwrap(),
        usage["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap(),
    )
}

/// Runs a three-turn conversation; returns each turn's (content, prompt tokens, cached tokens).
async fn conversation(server: &TestServer, questions: &[&str]) -> Vec<(String, u64, u64)> {
    let mut messages = vec![json!({"role": "system", "content": system_prompt()})];
    let mut turns = Vec::new();
    for question in questions {
        messages.push(json!({"role": "user", "content": question}));
        let turn = chat(server, &messages).await;
        messages.push(json!({"role": "assistant", "content": turn.0}));
        turns.push(turn);
    }
    turns
}

#[tokio::test]
async fn a_conversation_reuses_its_earlier_turns_and_answers_as_without_the_cache() {
    let questions = [
        "Who art thou?",
        "Whence comest thou, and why?",
        "What news from the north?",
    ];
    let cached = server(true).await;
    let with_cache = conversation(&cached, &questions).await;
    let plain = server(false).await;
    let without_cache = conversation(&plain, &questions).await;
    for (turn, (with, without)) in with_cache.iter().zip(&without_cache).enumerate() {
        assert_eq!(with.0, without.0, "turn {turn}: the answers differ");
        assert_eq!(with.1, without.1, "turn {turn}: the prompts differ");
        assert_eq!(without.2, 0, "turn {turn}: the cache is off");
    }
    // Turn 1 finds nothing; turns 2 and 3 reuse the previous turn's prompt up to its final assistant header.
    assert_eq!(with_cache[0].2, 0);
    for turn in 1..3 {
        let previous_prompt = with_cache[turn - 1].1;
        let (_, prompt, hit) = with_cache[turn];
        assert!(
            hit + 12 >= previous_prompt && hit < prompt,
            "turn {turn}: {hit} cached of {prompt}; the previous prompt had {previous_prompt}"
        );
    }
    let metric = |name: &'static str| {
        let server = &cached;
        async move { server.metric(name).await.unwrap_or(0.0) }
    };
    assert_eq!(metric("lily_prefix_cache_queries_total").await, 3.0);
    assert_eq!(metric("lily_prefix_cache_hits_total").await, 2.0);
    let hit_tokens = (with_cache[1].2 + with_cache[2].2) as f64;
    assert_eq!(metric("lily_prefix_cache_hit_tokens_total").await, hit_tokens);
    assert!(metric("lily_prefix_cache_snapshots").await >= 3.0);
    assert!(metric("lily_prefix_cache_bytes").await > 0.0);
    cached.shutdown().await;
    plain.shutdown().await;
}

#[tokio::test]
async fn requests_sharing_a_system_prompt_prefill_it_once() {
    let cached = server(true).await;
    let plain = server(false).await;
    let questions = [
        "Speak of the king.",
        "Speak of the queen.",
        "Speak of the fool.",
        "Speak of the sea.",
    ];
    let system = json!({"role": "system", "content": system_prompt()});
    let mut hits = Vec::new();
    for question in questions {
        let messages = [system.clone(), json!({"role": "user", "content": question})];
        let (with, prompt, hit) = chat(&cached, &messages).await;
        let (without, _, _) = chat(&plain, &messages).await;
        assert_eq!(with, without, "{question}: the answers differ");
        hits.push((prompt, hit));
    }
    // The first prefills the system prompt; the others take all of it (the tokens before the user's message).
    assert_eq!(hits[0].1, 0);
    let shared = hits[1].1;
    assert!(shared > 250, "{hits:?}");
    for &(prompt, hit) in &hits[1..] {
        assert_eq!(hit, shared, "{hits:?}");
        assert!(prompt - hit < 30, "{hits:?}");
    }
    // The same request again reuses all of its prompt up to the reply's header (the prompt's end is cached too,
    // but a prompt must leave its last token to prefill, for the logits).
    let messages = [system.clone(), json!({"role": "user", "content": questions[3]})];
    let (_, prompt, hit) = chat(&cached, &messages).await;
    assert!(hit > shared && prompt - hit < 12, "{hit} of {prompt}");
    cached.shutdown().await;
    plain.shutdown().await;
}

/// With many conversations and a snapshot budget that holds only a few, old snapshots are evicted, and every
/// answer still equals the one without the cache.
#[tokio::test]
async fn eviction_under_a_small_budget_keeps_answers_exact() {
    let mut config = common::config();
    config.context = Some(4096);
    config.pool.max_seqs = Some(2);
    // About three snapshots: one of the default model is ~3.3 MB of DeltaNet state and 4 KB a token of keys and
    // values (~5 MB for these ~420-token sequences).
    config.pool.prefix_cache_bytes = Some(16 << 20);
    let small = TestServer::real(config).await;
    let plain = server(false).await;
    for round in 0..2 {
        for who in ["king", "queen", "fool"] {
            let question = format!("Round {round}: tell me of the {who}.");
            let messages = [
                json!({"role": "system", "content": system_prompt()}),
                json!({"role": "user", "content": question}),
            ];
            let (with, _, _) = chat(&small, &messages).await;
            let (without, _, _) = chat(&plain, &messages).await;
            assert_eq!(with, without, "{question}");
        }
    }
    let evictions = small.metric("lily_prefix_cache_evictions_total").await.unwrap_or(0.0);
    assert!(evictions > 0.0, "the budget should have forced evictions");
    small.shutdown().await;
    plain.shutdown().await;
}

/// A chat reply is tokenized for the next turn while the client reads it: the next request's rendering of that
/// reply then finds it in the tokenizer's segment cache, which grows by the new question only
/// (`lily_tokenizer_segment_cache_bytes`). Both ways a reply is sent, whole and streamed.
#[tokio::test]
async fn a_chat_reply_is_tokenized_for_the_next_turn() {
    for stream in [false, true] {
        // A server and a reply of its own for each way, so that neither finds the other's reply cached.
        let reply: String = (0..80)
            .map(|i| format!("word{i}s{stream}"))
            .collect::<Vec<_>>()
            .join(" ");
        let s = TestServer::fake(common::config(), common::Script::text(&reply)).await;
        let cache_bytes = || async { s.metric("lily_tokenizer_segment_cache_bytes").await.unwrap() };
        // The gauge once it has reached `floor` and holds still: the reply is tokenized on a blocking thread after
        // the response, which a busy machine may run late, so the wait is for its bytes, not for a quiet moment.
        let settled = |floor: f64| async move {
            let mut last = -1.0;
            for _ in 0..300 {
                let now = cache_bytes().await;
                if now == last && now >= floor {
                    return now;
                }
                last = now;
                tokio::time::sleep(std::time::Duration::from_millis(30)).await;
            }
            panic!("the segment cache did not reach {floor} bytes and settle");
        };
        let question = format!("First question, streamed {stream}?");
        // The question's own segments go into the cache first, so that what the gauge gains after the answer is
        // the reply's alone.
        let first = json!({
            "messages": [{"role": "user", "content": question}],
            "add_generation_prompt": true,
            "chat_template_kwargs": {"enable_thinking": false},
        });
        let (status, r) = s.post("/tokenize", &first).await;
        assert_eq!(status, 200, "{r}");
        let initial = settled(0.0).await;
        let body = json!({
            "messages": [{"role": "user", "content": question}],
            "max_tokens": 2000,
            "temperature": 0,
            "stream": stream,
            "chat_template_kwargs": {"enable_thinking": false},
        });
        let content = if stream {
            let (status, data) = s.stream("/v1/chat/completions", &body).await;
            assert_eq!(status, 200);
            common::chunks(&data)
                .iter()
                .filter_map(|c| c["choices"][0]["delta"]["content"].as_str().map(str::to_string))
                .collect::<String>()
        } else {
            let (status, r) = s.post("/v1/chat/completions", &body).await;
            assert_eq!(status, 200, "{r}");
            r["choices"][0]["message"]["content"].as_str().unwrap().to_string()
        };
        assert_eq!(content, reply);
        // The reply's segment, counted for at least its text, is in once the warm-up has run.
        let before = settled(initial + reply.len() as f64).await;
        let next = json!({
            "messages": [
                {"role": "user", "content": question},
                {"role": "assistant", "content": content},
                {"role": "user", "content": "And then?"},
            ],
            "add_generation_prompt": true,
        });
        let (status, r) = s.post("/tokenize", &next).await;
        assert_eq!(status, 200, "{r}");
        let grown = settled(before).await - before;
        assert!(
            grown < reply.len() as f64,
            "streamed {stream}: the cache grew by {grown} bytes for the next turn, the reply is {} bytes",
            reply.len()
        );
        // The words of the questions are in the tokenizer's word cache, within its 16 MiB.
        let words = s.metric("lily_tokenizer_word_cache_bytes").await.unwrap();
        assert!(words > 0.0 && words <= (16 << 20) as f64, "word cache {words} bytes");
        s.shutdown().await;
    }
}
