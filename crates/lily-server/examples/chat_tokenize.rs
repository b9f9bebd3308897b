//! What turning a chat request into prompt tokens costs the server on a long conversation: a multi-turn chat on a
//! long document (the shapes of `scripts/bench_prefix.py chat`: a document of common words, ~200-word questions and
//! replies), rendered with the bundled model's chat template and tokenized with its tokenizer by `render_tokens`,
//! as every chat request is. For each turn it prints the time of `render_tokens` and of its two parts: rendering
//! the conversation with the template, and tokenizing the rendered text, the latter both without the tokenizer's
//! segment cache and with the cache holding what the turn before left there (as in a server that served it).
//!
//!     cargo run --release -p lily-server --example chat_tokenize -- [--doc-words N] [--turns N] [--thinking] [--tools]

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use lily_chat::tokenizer::DEFAULT_SEGMENT_CACHE_BYTES;
use lily_chat::{ChatTemplate, PlainMarker, Tokenizer};
use lily_server::chat::{render, render_tokens};
use lily_server::limits::{prompt_limit, RequestLimits};
use lily_server::params::GenerationDefaults;
use lily_server::server::{LazyStructured, Ready};
use serde_json::{json, Map, Value as Json};

/// Common English words, most of them one token each (the list `scripts/bench_prefix.py` draws from).
const WORDS: &str = "the of and to in is was he for it with as his on be at by had are but from or have an they which \
    one you were all we her she there been their if has will more when would who so no out up into than them can \
    only other new some could time these two may then first any my now such like our over man me even most made \
    after also did many before must through back years where much your way well down should because each just those \
    people how too little state good very make world still own see men work long get here between both life being \
    under never day same another know while last might us great old year off come since against go came right used \
    take three";

/// Times each measurement is repeated; the median is printed.
const REPEATS: usize = 7;

struct Options {
    doc_words: usize,
    turns: usize,
    user_words: usize,
    reply_words: usize,
    thinking: bool,
    tools: bool,
}

fn options() -> Result<Options> {
    let mut o = Options {
        doc_words: 16_000,
        turns: 10,
        user_words: 200,
        reply_words: 200,
        thinking: false,
        tools: false,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut number = |name: &str| -> Result<usize> {
            let value = args.next().with_context(|| format!("{name} needs a number"))?;
            value.parse().with_context(|| format!("{name} {value}"))
        };
        match arg.as_str() {
            "--doc-words" => o.doc_words = number("--doc-words")?,
            "--turns" => o.turns = number("--turns")?,
            "--user-words" => o.user_words = number("--user-words")?,
            "--reply-words" => o.reply_words = number("--reply-words")?,
            "--thinking" => o.thinking = true,
            "--tools" => o.tools = true,
            other => bail!("unknown argument {other}"),
        }
    }
    Ok(o)
}

/// A fixed sequence of words drawn from [`WORDS`] (xorshift, so every run measures the same text).
struct Words {
    list: Vec<&'static str>,
    state: u64,
}

impl Words {
    fn take(&mut self, count: usize) -> String {
        let mut out = Vec::with_capacity(count);
        for _ in 0..count {
            self.state ^= self.state << 13;
            self.state ^= self.state >> 7;
            self.state ^= self.state << 17;
            out.push(self.list[(self.state % self.list.len() as u64) as usize]);
        }
        out.join(" ")
    }
}

fn tools(words: &[&str]) -> Vec<Json> {
    ["search_documents", "read_file", "run_query", "send_message"]
        .iter()
        .enumerate()
        .map(|(i, name)| {
            json!({"type": "function", "function": {
                "name": name,
                "description": format!("{}: {}", name.replace('_', " "), words[i..i + 40].join(" ")),
                "parameters": {"type": "object", "properties": {"query": {"type": "string"},
                    "limit": {"type": "integer"}}, "required": ["query"]},
            }})
        })
        .collect()
}

fn median(mut times: Vec<Duration>) -> f64 {
    times.sort();
    times[times.len() / 2].as_secs_f64() * 1e3
}

fn time<T>(mut f: impl FnMut() -> T) -> f64 {
    median(
        (0..REPEATS)
            .map(|_| {
                let start = Instant::now();
                std::hint::black_box(f());
                start.elapsed()
            })
            .collect(),
    )
}

fn main() -> Result<()> {
    let o = options()?;
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/lily-tiny-shakespeare");
    let tokenizer = Arc::new(Tokenizer::from_dir(&dir)?);
    let vocab_size = tokenizer.vocab_size();
    let context = 1 << 20;
    let ready = Ready {
        tokenizer: tokenizer.clone(),
        template: ChatTemplate::from_dir(&dir)?,
        context,
        vocab_size,
        defaults: GenerationDefaults::default(),
        backend_name: "none".into(),
        max_seqs: 1,
        kv_tokens: context,
        max_prefill_tokens: 4096,
        prefix_cache: true,
        limits: RequestLimits {
            max_choices: 1,
            max_request_tokens: usize::MAX,
        },
        special_tokens_in_content: false,
        structured: Arc::new(LazyStructured::new(tokenizer.clone(), vocab_size)),
    };
    let list: Vec<&str> = WORDS.split_whitespace().collect();
    let tools = if o.tools { tools(&list) } else { Vec::new() };
    let mut words = Words {
        list,
        state: 0x9E37_79B9_7F4A_7C15,
    };
    let mut kwargs = Map::new();
    kwargs.insert("enable_thinking".into(), Json::Bool(o.thinking));
    let document = words.take(o.doc_words);
    let mut messages =
        vec![json!({"role": "system", "content": "You answer questions about the document the user gives."})];
    println!(
        "{} turns on a {}-word document ({} words a question and a reply), thinking {}, tools {}; median of {REPEATS} \
         runs",
        o.turns,
        o.doc_words,
        o.user_words,
        if o.thinking { "on" } else { "off" },
        if o.tools { "on" } else { "off" },
    );
    println!("                render_tokens ms       tokenize ms");
    println!("turn  tokens  new turn  no cache  render ms  new turn  no cache");
    let limit = prompt_limit(context);
    let mut previous: Option<String> = None;
    for turn in 0..o.turns {
        let question = words.take(o.user_words);
        let content = if turn == 0 {
            format!("Document:\n{document}\n\nQuestion: {question}")
        } else {
            question
        };
        messages.push(json!({"role": "user", "content": content}));
        let render_tokens = || render_tokens(&ready, messages.clone(), &tools, kwargs.clone(), true);
        let text =
            render(&ready, messages.clone(), &tools, kwargs.clone(), true).map_err(|e| anyhow::anyhow!("{e:?}"))?;
        let marker = PlainMarker::choose([text.as_str()]).context("no free marker")?;
        // The segment cache as the turn before left it: emptied, then filled by the previous turn's prompt.
        let after_previous_turn = || {
            tokenizer.set_segment_cache_bytes(0);
            tokenizer.set_segment_cache_bytes(DEFAULT_SEGMENT_CACHE_BYTES);
            if let Some(previous) = &previous {
                tokenizer.encode_marked(previous, marker, limit).unwrap();
            }
        };
        let timed_after_previous_turn = |f: &mut dyn FnMut()| {
            median(
                (0..REPEATS)
                    .map(|_| {
                        after_previous_turn();
                        let start = Instant::now();
                        f();
                        start.elapsed()
                    })
                    .collect(),
            )
        };
        let total_new = timed_after_previous_turn(&mut || {
            std::hint::black_box(render_tokens().unwrap());
        });
        let tokenize_new = timed_after_previous_turn(&mut || {
            std::hint::black_box(tokenizer.encode_marked(&text, marker, limit).unwrap());
        });
        tokenizer.set_segment_cache_bytes(0);
        let (_, tokens) = render_tokens().map_err(|e| anyhow::anyhow!("{e:?}"))?;
        let total_cold = time(render_tokens);
        let tokenize_cold = time(|| tokenizer.encode_marked(&text, marker, limit));
        let rendering = time(|| render(&ready, messages.clone(), &tools, kwargs.clone(), true));
        println!(
            "{:>4}  {:>6}  {total_new:>8.2}  {total_cold:>8.2}  {rendering:>9.2}  {tokenize_new:>8.2}  {tokenize_cold:>8.2}",
            turn + 1,
            tokens.len()
        );
        previous = Some(text);
        messages.push(json!({"role": "assistant", "content": words.take(o.reply_words)}));
    }
    Ok(())
}
