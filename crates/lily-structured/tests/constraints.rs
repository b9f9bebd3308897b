//! Constraints walked with random logits over the real tokenizer of the bundled model: whatever the sampler draws
//! among the allowed tokens, the decoded text must satisfy the constraint (checked with a JSON Schema validator, the
//! chat crate's tool-call parser, or a regular expression). The model itself is exercised through the server's
//! tests; here every token of the vocabulary is a candidate at every step, which is the harder case.

use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use lily_chat::{Tokenizer, ToolCallEvent, ToolCallIds, ToolCallParser};
use lily_model::rng::Rng;
use lily_model::sampling::{Sampler, SamplingParams};
use lily_structured::{Constraint, ConstraintError, ConstraintSpec, Grammar, StructuredEnv};
use serde_json::{json, Value as Json};

struct Fixture {
    tokenizer: Arc<Tokenizer>,
    env: StructuredEnv,
    vocab_size: usize,
}

fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/lily-tiny-shakespeare");
        let tokenizer = Arc::new(Tokenizer::from_dir(&dir).expect("the bundled tokenizer loads"));
        let vocab_size = lily_model::Config::from_dir(&dir).expect("config.json").vocab_size;
        let start = Instant::now();
        let env = StructuredEnv::new(tokenizer.clone(), vocab_size).expect("the token trie builds");
        eprintln!("token trie and parser factory: {:.1} ms", ms(start.elapsed()));
        Fixture {
            tokenizer,
            env,
            vocab_size,
        }
    })
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// What a walk produced: the text before the end-of-turn token, whether that token came, and the time spent
/// computing masks.
struct Walk {
    text: String,
    ended: bool,
    tokens: usize,
    mask_time: Duration,
}

/// Draws up to `max_tokens` tokens from random logits under the constraint. The end-of-turn token gets a bonus, so
/// that walks end soon once the constraint allows them to.
fn walk(grammar: &Grammar, seed: u64, max_tokens: usize, in_reasoning: bool) -> Walk {
    let fx = fixture();
    let eos = fx.tokenizer.special().eos_ids();
    let mut constraint = Constraint::new(grammar, in_reasoning);
    let mut sampler = Sampler::new(SamplingParams {
        temperature: 1.0,
        seed,
        ..Default::default()
    });
    let mut rng = Rng::new(seed ^ 0x5eed);
    let mut logits = vec![0f32; fx.vocab_size];
    let mut tokens = Vec::new();
    let mut mask_time = Duration::ZERO;
    let mut ended = false;
    while tokens.len() < max_tokens {
        for (i, l) in logits.iter_mut().enumerate() {
            *l = rng.uniform() * 4.0 + if eos.contains(&(i as u32)) { 8.0 } else { 0.0 };
        }
        let start = Instant::now();
        let mask = constraint.mask().expect("a mask").map(<[u32]>::to_vec);
        mask_time += start.elapsed();
        let token = match mask {
            Some(mask) => sampler.sample_masked(&mut logits, &mask),
            None => sampler.sample(&logits),
        };
        constraint.consume(token).expect("the drawn token is allowed");
        if eos.contains(&token) {
            ended = true;
            break;
        }
        tokens.push(token);
    }
    Walk {
        text: fx.tokenizer.decode(&tokens, false).expect("decodes"),
        ended,
        tokens: tokens.len(),
        mask_time,
    }
}

fn compile(spec: &ConstraintSpec) -> (Grammar, Duration) {
    let start = Instant::now();
    let grammar = fixture().env.compile(spec).expect("the constraint compiles");
    (grammar, start.elapsed())
}

fn schemas() -> Vec<(&'static str, Json)> {
    vec![
        (
            "nested objects",
            json!({
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 12},
                    "address": {
                        "type": "object",
                        "properties": {
                            "city": {"type": "string", "maxLength": 12},
                            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}
                        },
                        "required": ["city", "zip"],
                        "additionalProperties": false
                    }
                },
                "required": ["name", "address"],
                "additionalProperties": false
            }),
        ),
        (
            "arrays with min and max items",
            json!({
                "type": "object",
                "properties": {
                    "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 2, "maxItems": 4},
                    "scores": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}
                },
                "required": ["tags", "scores"],
                "additionalProperties": false
            }),
        ),
        (
            "enums and integer ranges",
            json!({
                "type": "object",
                "properties": {
                    "color": {"enum": ["red", "green", "blue"]},
                    "count": {"type": "integer", "minimum": 1, "maximum": 10},
                    "ratio": {"type": "number", "minimum": 0, "maximum": 1}
                },
                "required": ["color", "count", "ratio"],
                "additionalProperties": false
            }),
        ),
        (
            "anyOf",
            json!({
                "type": "object",
                "properties": {
                    "value": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 8}, {"type": "null"}]},
                    "flag": {"anyOf": [{"type": "boolean"}, {"const": "unknown"}]}
                },
                "required": ["value", "flag"],
                "additionalProperties": false
            }),
        ),
        (
            "string patterns and formats",
            json!({
                "type": "object",
                "properties": {
                    "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2,4}$"},
                    "day": {"type": "string", "format": "date"},
                    "id": {"type": "string", "format": "uuid"}
                },
                "required": ["code", "day", "id"],
                "additionalProperties": false
            }),
        ),
        (
            "required and optional fields",
            json!({
                "type": "object",
                "properties": {
                    "a": {"type": "boolean"},
                    "b": {"type": "number"},
                    "c": {"type": "string", "maxLength": 5},
                    "d": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}
                },
                "required": ["a"],
                "additionalProperties": false
            }),
        ),
        (
            "references to $defs (Pydantic's shape)",
            json!({
                "$defs": {
                    "Item": {
                        "type": "object",
                        "properties": {"name": {"type": "string", "maxLength": 8}, "qty": {"type": "integer", "minimum": 0}},
                        "required": ["name", "qty"],
                        "additionalProperties": false
                    }
                },
                "type": "object",
                "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/Item"}, "minItems": 1, "maxItems": 2}},
                "required": ["items"],
                "additionalProperties": false
            }),
        ),
    ]
}

fn validator(schema: &Json) -> jsonschema::Validator {
    jsonschema::options()
        .should_validate_formats(true)
        .build(schema)
        .expect("the test schema is valid")
}

#[test]
fn json_schemas_produce_valid_json() {
    let mut report = Vec::new();
    for (name, schema) in schemas() {
        let (grammar, compile_time) = compile(&ConstraintSpec::JsonSchema(schema.clone()));
        let validator = validator(&schema);
        let (mut tokens, mut mask_time) = (0, Duration::ZERO);
        for seed in 0..4 {
            let walk = walk(&grammar, seed, 400, false);
            assert!(
                walk.ended,
                "{name}, seed {seed}: no end within 400 tokens: {:?}",
                walk.text
            );
            let value: Json = serde_json::from_str(&walk.text)
                .unwrap_or_else(|e| panic!("{name}, seed {seed}: not JSON ({e}): {:?}", walk.text));
            assert!(
                validator.is_valid(&value),
                "{name}, seed {seed}: the schema refuses {value}"
            );
            tokens += walk.tokens;
            mask_time += walk.mask_time;
        }
        report.push(format!(
            "{name}: compile {:.1} ms, mask {:.3} ms/token over {tokens} tokens",
            ms(compile_time),
            ms(mask_time) / tokens.max(1) as f64
        ));
    }
    eprintln!("{}", report.join("\n"));
}

#[test]
fn json_object_mode_produces_an_object() {
    let (grammar, _) = compile(&ConstraintSpec::JsonObject);
    for seed in 0..2 {
        let walk = walk(&grammar, seed, 300, false);
        if walk.ended {
            let value: Json = serde_json::from_str(&walk.text).expect("JSON");
            assert!(value.is_object(), "{value}");
        } else {
            assert!(walk.text.starts_with('{'), "{:?}", walk.text);
        }
    }
}

#[test]
fn regex_and_choice_and_lark_hold() {
    let re = regex_lite_match("[a-z]{3}-[0-9]{2}");
    let (grammar, _) = compile(&ConstraintSpec::Regex("[a-z]{3}-[0-9]{2}".into()));
    for seed in 0..4 {
        let walk = walk(&grammar, seed, 50, false);
        assert!(walk.ended && re(&walk.text), "{:?}", walk.text);
    }
    let choices = vec!["yes".to_string(), "no".to_string(), "maybe not".to_string()];
    let (grammar, _) = compile(&ConstraintSpec::Choice(choices.clone()));
    for seed in 0..6 {
        let walk = walk(&grammar, seed, 50, false);
        assert!(walk.ended && choices.contains(&walk.text), "{:?}", walk.text);
    }
    let (grammar, _) = compile(&ConstraintSpec::Lark(
        "start: greeting \" \" name\ngreeting: \"hello\" | \"hi\"\nname: /[A-Z][a-z]{1,5}/".into(),
    ));
    for seed in 0..4 {
        let walk = walk(&grammar, seed, 50, false);
        let ok = walk.ended
            && ["hello ", "hi "].iter().any(|g| {
                walk.text.strip_prefix(g).is_some_and(|n| {
                    let mut chars = n.chars();
                    chars.next().is_some_and(|c| c.is_ascii_uppercase())
                        && (2..=6).contains(&n.len())
                        && chars.all(|c| c.is_ascii_lowercase())
                })
            });
        assert!(ok, "{:?}", walk.text);
    }
}

/// A matcher for the one regex shape the test uses: three lowercase letters, a dash, two digits.
fn regex_lite_match(_pattern: &str) -> impl Fn(&str) -> bool {
    |text: &str| {
        let b = text.as_bytes();
        b.len() == 6
            && b[..3].iter().all(u8::is_ascii_lowercase)
            && b[3] == b'-'
            && b[4..].iter().all(u8::is_ascii_digit)
    }
}

fn tools() -> Vec<Json> {
    vec![
        json!({"type": "function", "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "location": {"type": "string", "maxLength": 16},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                    "hourly": {"type": "boolean"}
                },
                "required": ["location", "days"]
            }
        }}),
        json!({"type": "function", "function": {
            "name": "add_tags",
            "parameters": {
                "type": "object",
                "properties": {
                    "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 1, "maxItems": 3},
                    "note": {"anyOf": [{"type": "string", "maxLength": 10}, {"type": "null"}]}
                },
                "required": ["tags"]
            }
        }}),
    ]
}

#[test]
fn tool_calls_parse_with_schema_valid_arguments() {
    let tools = tools();
    for at_most_one in [true, false] {
        let (grammar, compile_time) = compile(&ConstraintSpec::ToolCalls {
            tools: tools.clone(),
            at_most_one,
        });
        eprintln!(
            "tool calls (at_most_one {at_most_one}): compile {:.1} ms",
            ms(compile_time)
        );
        for seed in 0..5 {
            let walk = walk(&grammar, seed, 400, false);
            assert!(walk.ended, "seed {seed}: {:?}", walk.text);
            let mut parser = ToolCallParser::new(&tools, ToolCallIds::Sequential);
            let mut events = parser.push(&walk.text);
            events.extend(parser.finish());
            let calls: Vec<_> = events
                .iter()
                .map(|e| match e {
                    ToolCallEvent::Call(call) => call,
                    ToolCallEvent::Content(text) => panic!("seed {seed}: content {text:?} in {:?}", walk.text),
                })
                .collect();
            assert!(!calls.is_empty(), "{:?}", walk.text);
            if at_most_one {
                assert_eq!(calls.len(), 1, "{:?}", walk.text);
            }
            for call in calls {
                let tool = tools
                    .iter()
                    .find(|t| t["function"]["name"] == call.name.as_str())
                    .expect("a known name");
                let arguments: Json = serde_json::from_str(&call.arguments).expect("arguments are JSON");
                assert!(
                    validator(&tool["function"]["parameters"]).is_valid(&arguments),
                    "seed {seed}: {} refuses {arguments} (from {:?})",
                    call.name,
                    walk.text
                );
            }
        }
    }
}

/// Whether `token` is allowed by `mask`.
fn allowed(mask: &[u32], token: u32) -> bool {
    mask[token as usize / 32] & (1 << (token % 32)) != 0
}

#[test]
fn a_reply_that_may_call_tools_calls_them_or_answers_as_asked() {
    let fx = fixture();
    let tools = tools();
    let schema = json!({"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                        "required": ["city"], "additionalProperties": false});
    let answers = [
        ConstraintSpec::JsonSchema(schema.clone()),
        ConstraintSpec::JsonObject,
        ConstraintSpec::Choice(vec!["yes".into(), "no".into()]),
        ConstraintSpec::Regex("[a-z]{2,5}".into()),
    ];
    for answer in answers {
        let spec = ConstraintSpec::ToolCallsOr {
            tools: tools.clone(),
            at_most_one: false,
            answer: Box::new(answer.clone()),
        };
        let (grammar, _) = compile(&spec);
        // Both ways are open at the start: the tool call's opening token, and the answer's first letters.
        let mut constraint = Constraint::new(&grammar, false);
        let mask = constraint.mask().unwrap().unwrap().to_vec();
        let opening = match &answer {
            ConstraintSpec::Choice(_) => "yes",
            ConstraintSpec::Regex(_) => "abc",
            _ => "{",
        };
        let first = fx.tokenizer.encode(opening, false).unwrap()[0];
        assert!(allowed(&mask, fx.tokenizer.special().tool_call_start), "{answer:?}");
        assert!(allowed(&mask, first), "{answer:?}: {opening:?}");
        // Once the answer has begun, no tool call may follow.
        constraint.consume(first).unwrap();
        let mask = constraint.mask().unwrap().unwrap().to_vec();
        assert!(!allowed(&mask, fx.tokenizer.special().tool_call_start), "{answer:?}");

        // Whichever way a walk goes, its text is whole tool calls with valid arguments, or a valid answer.
        let (mut calls_seen, mut answers_seen) = (0, 0);
        for seed in 0..12 {
            let walk = walk(&grammar, seed, 400, false);
            if !walk.ended {
                // Only an object's free strings can go on this long.
                assert!(
                    answer == ConstraintSpec::JsonObject && walk.text.starts_with('{'),
                    "{:?}",
                    walk.text
                );
                continue;
            }
            if walk.text.starts_with("<tool_call>") {
                calls_seen += 1;
                let mut parser = ToolCallParser::new(&tools, ToolCallIds::Sequential);
                let mut events = parser.push(&walk.text);
                events.extend(parser.finish());
                assert!(!events.is_empty(), "{:?}", walk.text);
                for event in events {
                    let ToolCallEvent::Call(call) = event else {
                        panic!("{answer:?} seed {seed}: content beside the calls in {:?}", walk.text);
                    };
                    let tool = tools
                        .iter()
                        .find(|t| t["function"]["name"] == call.name.as_str())
                        .expect("a known name");
                    let arguments: Json = serde_json::from_str(&call.arguments).expect("arguments are JSON");
                    assert!(validator(&tool["function"]["parameters"]).is_valid(&arguments));
                }
                continue;
            }
            answers_seen += 1;
            match &answer {
                ConstraintSpec::JsonSchema(schema) => {
                    let value: Json = serde_json::from_str(&walk.text).expect("the answer is JSON");
                    assert!(validator(schema).is_valid(&value), "{value}");
                }
                ConstraintSpec::JsonObject => {
                    let value: Json = serde_json::from_str(&walk.text).expect("the answer is JSON");
                    assert!(value.is_object(), "{value}");
                }
                ConstraintSpec::Choice(choices) => assert!(choices.contains(&walk.text), "{:?}", walk.text),
                _ => assert!(
                    (2..=5).contains(&walk.text.len()) && walk.text.bytes().all(|b| b.is_ascii_lowercase()),
                    "{:?}",
                    walk.text
                ),
            }
        }
        eprintln!("{answer:?}: {calls_seen} walks called tools, {answers_seen} answered");
        // The walks are seeded, so which way each goes is fixed: with a JSON schema both ways are taken.
        if matches!(answer, ConstraintSpec::JsonSchema(_)) {
            assert!(
                calls_seen > 0 && answers_seen > 0,
                "{calls_seen} calls, {answers_seen} answers"
            );
        }
    }
    // A Lark answer keeps its own start rule and lexer, and a thinking reply meets the union after `</think>`.
    let lark = ConstraintSpec::Lark("start: \"ok\" | \"no\"".into());
    let spec = ConstraintSpec::ToolCallsOr {
        tools: tools.clone(),
        at_most_one: true,
        answer: Box::new(lark),
    };
    let (grammar, _) = compile(&spec);
    let mut constraint = Constraint::new(&grammar, true);
    constraint.consume(fx.tokenizer.special().think_end).unwrap();
    let mask = constraint.mask().unwrap().unwrap().to_vec();
    let ok = fx.tokenizer.encode("ok", false).unwrap()[0];
    assert!(allowed(&mask, ok) && allowed(&mask, fx.tokenizer.special().tool_call_start));
    for seed in 0..4 {
        let walk = walk(&grammar, seed, 400, false);
        assert!(walk.ended, "{:?}", walk.text);
        assert!(
            ["ok", "no"].contains(&walk.text.as_str()) || walk.text.starts_with("<tool_call>"),
            "{:?}",
            walk.text
        );
    }
    // An answer that may itself call tools is refused.
    let nested = ConstraintSpec::ToolCallsOr {
        tools: tools.clone(),
        at_most_one: true,
        answer: Box::new(ConstraintSpec::ToolCallsOr {
            tools,
            at_most_one: true,
            answer: Box::new(ConstraintSpec::JsonObject),
        }),
    };
    assert!(matches!(
        fixture().env.compile(&nested),
        Err(ConstraintError::Invalid(_))
    ));
}

#[test]
fn the_constraint_starts_after_the_think_block() {
    let fx = fixture();
    let special = *fx.tokenizer.special();
    let (grammar, _) = compile(&ConstraintSpec::Choice(vec!["ok".into()]));
    let mut constraint = Constraint::new(&grammar, true);
    // In the reasoning: every token but the end-of-turn ones.
    let mask = constraint.mask().unwrap().unwrap().to_vec();
    assert!(!allowed(&mask, special.im_end) && !allowed(&mask, special.endoftext));
    let free = fx.tokenizer.encode("Thinking, not ok", false).unwrap();
    assert!(free.iter().all(|&t| allowed(&mask, t)));
    for t in free {
        constraint.consume(t).unwrap();
    }
    constraint.consume(special.think_end).unwrap();
    // Right after `</think>`: the constraint's first tokens, and one newline token of layout.
    let mask = constraint.mask().unwrap().unwrap().to_vec();
    let ok = fx.tokenizer.encode("ok", false).unwrap();
    let newline = fx.tokenizer.encode("\n", false).unwrap();
    assert!(allowed(&mask, ok[0]) && allowed(&mask, newline[0]));
    constraint.consume(newline[0]).unwrap();
    let mask = constraint.mask().unwrap().unwrap().to_vec();
    assert!(!allowed(&mask, newline[0]));
    // Only tokens that spell a prefix of "ok" are allowed, "ok" among them.
    assert!(allowed(&mask, ok[0]));
    for token in 0..fx.vocab_size as u32 {
        if allowed(&mask, token) {
            let bytes = lily_chat::token_bytes::token_bytes(&fx.tokenizer, token);
            assert!(
                !bytes.is_empty() && b"ok".starts_with(&bytes),
                "token {token}: {bytes:?}"
            );
        }
    }
    // A token the constraint refuses is an error.
    let bad = fx.tokenizer.encode("no", false).unwrap()[0];
    assert!(matches!(constraint.consume(bad), Err(ConstraintError::Step(_))));
}

#[test]
fn bad_constraints_are_refused_with_the_reason() {
    let env = &fixture().env;
    let cases = [
        ConstraintSpec::JsonSchema(json!({"type": "object", "properties": {"x": {"type": "strng"}}})),
        ConstraintSpec::JsonSchema(json!({"type": "integer", "minimum": 5, "maximum": 1})),
        ConstraintSpec::JsonSchema(json!({"$ref": "#/$defs/Missing"})),
        ConstraintSpec::Regex("[a-".into()),
        ConstraintSpec::Lark("start: undefined_rule".into()),
        ConstraintSpec::Choice(Vec::new()),
        ConstraintSpec::ToolCalls {
            tools: vec![json!({"type": "function", "function": {"name": "f", "parameters": {
                "type": "object", "properties": {}, "required": ["missing"]}}})],
            at_most_one: true,
        },
    ];
    for spec in cases {
        match env.compile(&spec) {
            Err(ConstraintError::Invalid(message)) => {
                assert!(!message.is_empty());
                eprintln!("{spec:?}: {message}");
            }
            other => panic!("{spec:?} was not refused: {other:?}"),
        }
    }
}
