//! The chat template rendered by lily against Hugging Face transformers' renderings of the same conversations
//! (tests/golden/chat_templates.json, made by scripts/chat_golden.py).

mod common;

use lily_chat::{ChatTemplate, ReasoningParser, RenderRequest, TemplateError};
use serde_json::{json, Map, Value};

/// The released Qwen3.6 chat template (the one the golden renderings were made with). The bundled model's own
/// template differs only in turning thinking off unless it is asked for.
fn template() -> ChatTemplate {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../lily-model/src/qwen3_6_chat_template.jinja"
    );
    ChatTemplate::from_source(std::fs::read_to_string(path).unwrap()).unwrap()
}

fn golden_cases() -> Vec<Value> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/golden/chat_templates.json");
    let document: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    document["cases"].as_array().unwrap().clone()
}

fn request(case: &Value) -> RenderRequest {
    RenderRequest {
        messages: case["messages"].as_array().unwrap().clone(),
        tools: case["tools"].as_array().cloned(),
        add_generation_prompt: case["add_generation_prompt"].as_bool().unwrap(),
        kwargs: case["kwargs"].as_object().unwrap().clone(),
    }
}

fn user(text: &str) -> RenderRequest {
    RenderRequest {
        messages: vec![json!({"role": "user", "content": text})],
        add_generation_prompt: true,
        ..Default::default()
    }
}

#[test]
fn matches_hugging_face_byte_for_byte() {
    let template = template();
    let tokenizer = common::tokenizer();
    let cases = golden_cases();
    assert!(cases.len() >= 12);
    for case in &cases {
        let name = case["name"].as_str().unwrap();
        let rendered = template.render(&request(case));
        match (case.get("expected"), case.get("expected_error")) {
            (Some(expected), None) => {
                let rendered = rendered.unwrap_or_else(|error| panic!("{name}: {error}"));
                assert_eq!(rendered, expected.as_str().unwrap(), "{name}");
                let ids: Vec<u32> = serde_json::from_value(case["expected_ids"].clone()).unwrap();
                assert_eq!(tokenizer.encode(&rendered, false).unwrap(), ids, "{name}: token ids");
            }
            (None, Some(expected_error)) => match rendered {
                Err(TemplateError::Raised { message }) => {
                    assert_eq!(message, expected_error.as_str().unwrap(), "{name}")
                }
                other => {
                    panic!("{name}: expected the template to raise {expected_error}, got {other:?}")
                }
            },
            _ => panic!("{name}: golden case has neither expected nor expected_error"),
        }
    }
}

#[test]
fn raised_errors_read_well() {
    let request = RenderRequest {
        messages: vec![json!({"role": "system", "content": "x"})],
        ..Default::default()
    };
    let error = template().render(&request).unwrap_err();
    assert_eq!(
        error.to_string(),
        "the chat template rejected the conversation: No user query found in messages."
    );
}

#[test]
fn images_and_other_media_are_refused() {
    let template = template();
    for (part, part_type) in [
        (
            json!({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}),
            "image_url",
        ),
        (json!({"type": "image", "image": "x.png"}), "image"),
        (
            json!({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}),
            "input_audio",
        ),
        (json!({"type": "video_url", "video_url": {"url": "v.mp4"}}), "video_url"),
    ] {
        let request = RenderRequest {
            messages: vec![json!({"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]})],
            add_generation_prompt: true,
            ..Default::default()
        };
        let error = template.render(&request).unwrap_err();
        assert!(
            matches!(&error, TemplateError::UnsupportedContentPart { index: 0, part_type: found } if found == part_type)
        );
        assert!(error.to_string().contains(&format!("\"{part_type}\"")), "{error}");
    }
}

#[test]
fn generation_prompt_sets_the_reasoning_start_state() {
    let template = template();
    let thinking = template.render(&user("Hi")).unwrap();
    assert!(thinking.ends_with("<|im_start|>assistant\n<think>\n"));
    assert!(ReasoningParser::for_prompt(&thinking).in_reasoning());

    let mut no_thinking = user("Hi");
    no_thinking.kwargs = Map::from_iter([("enable_thinking".to_string(), json!(false))]);
    let no_thinking = template.render(&no_thinking).unwrap();
    assert!(no_thinking.ends_with("<think>\n\n</think>\n\n"));
    assert!(!ReasoningParser::for_prompt(&no_thinking).in_reasoning());
}

#[test]
fn the_bundled_model_template_renders() {
    let model_dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/lily-tiny-shakespeare");
    let template = ChatTemplate::from_dir(&model_dir).unwrap();
    // The bundled model was trained with empty think blocks: its template closes the block unless asked not to.
    assert_eq!(
        template.render(&user("Hi")).unwrap(),
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    );
    // Asked for explicitly, each setting renders as the real template renders it.
    let real = self::template();
    for thinking in [true, false] {
        let mut request = user("Hi");
        request.kwargs = Map::from_iter([("enable_thinking".to_string(), json!(thinking))]);
        assert_eq!(template.render(&request).unwrap(), real.render(&request).unwrap());
    }
}

#[test]
fn bad_arguments_do_not_panic() {
    let template = template();
    let odd_messages = [
        json!([]),
        json!([{"role": "user", "content": 5}]),
        json!([{"role": "user"}]),
        json!([{"content": "no role"}]),
        json!([{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {"a": [1, {"b": null}]}}}]}]),
        json!([{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": "nope"}]),
        json!([{"role": "user", "content": "hi"}, {"role": "tool", "content": {"weird": true}}]),
    ];
    for messages in odd_messages {
        let request = RenderRequest {
            messages: messages.as_array().unwrap().clone(),
            tools: Some(vec![json!("not an object"), json!(null)]),
            add_generation_prompt: true,
            kwargs: Map::new(),
        };
        // Only the absence of a panic is asserted: errors are fine, and reported as errors.
        let _ = template.render(&request);
    }
}
