//! The `lily` binary end to end: tokenize, render, generate (plain and --chat), and its errors. Commands without
//! `--model` use the bundled default model.

use std::io::Write;
use std::process::{Command, Output, Stdio};

fn lily(args: &[&str]) -> Output {
    lily_with_input(args, "")
}

fn lily_with_input(args: &[&str], input: &str) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_lily"))
        .args(args)
        .env_remove("LILY_MODEL")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running lily");
    child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    child.wait_with_output().unwrap()
}

fn stdout(output: &Output) -> String {
    String::from_utf8(output.stdout.clone()).expect("stdout is UTF-8")
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// Runs and expects success; returns stdout.
fn ok(args: &[&str]) -> String {
    let output = lily(args);
    assert!(output.status.success(), "lily {args:?} failed: {}", stderr(&output));
    stdout(&output)
}

/// Runs and expects exit code 1 with an `error: ...` message and no panic; returns stderr.
fn fails(args: &[&str], input: &str) -> String {
    let output = lily_with_input(args, input);
    let message = stderr(&output);
    assert_eq!(
        output.status.code(),
        Some(1),
        "lily {args:?}: stdout {:?}, stderr {message:?}",
        stdout(&output)
    );
    assert!(message.contains("error: "), "{message:?}");
    assert!(!message.contains("panicked"), "{message:?}");
    message
}

const FOX: &str = "The quick brown fox jumps over the lazy dog.";
const FOX_IDS: &str = "[760, 3841, 13477, 37550, 33075, 888, 279, 15217, 5388, 13]";

#[test]
fn tokenize_pins_known_ids() {
    assert_eq!(ok(&["tokenize", FOX]), format!("{FOX_IDS}\n"));
    // From standard input when no text is given.
    let output = lily_with_input(&["tokenize"], FOX);
    assert_eq!(stdout(&output), format!("{FOX_IDS}\n"));
}

#[test]
fn decode_round_trips() {
    assert_eq!(ok(&["tokenize", "--decode", FOX_IDS]), format!("{FOX}\n"));
    assert_eq!(
        ok(&[
            "tokenize",
            "--decode",
            "760 3841, 13477,37550 33075 888 279 15217 5388 13"
        ]),
        format!("{FOX}\n")
    );

    let text = "<|im_start|>user\nCafé, 你好 👋 — \"quoted\"\n\ttabs<|im_end|>\n";
    let ids = ok(&["tokenize", text]);
    let parsed: Vec<u32> = serde_json::from_str(&ids).unwrap();
    assert_eq!(parsed[0], 248045, "<|im_start|> is one special token");
    assert_eq!(ok(&["tokenize", "--decode", ids.trim()]), format!("{text}\n"));
    let skipped = ok(&["tokenize", "--decode", "--skip-special", ids.trim()]);
    assert_eq!(skipped, "user\nCafé, 你好 👋 — \"quoted\"\n\ttabs\n\n");
}

#[test]
fn decode_refuses_bad_ids() {
    let message = fails(&["tokenize", "--decode", "[760, 999999]"], "");
    assert!(message.contains("unknown token id 999999"), "{message}");
    let message = fails(&["tokenize", "--decode", "760 fox"], "");
    assert!(message.contains("\"fox\" is not a token id"), "{message}");
    let message = fails(&["tokenize", "--decode", "[760, -1]"], "");
    assert!(message.contains("-1 is not a token id"), "{message}");
}

const CONVERSATION: &str = r#"{
  "model": "lily",
  "messages": [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello.", "reasoning_content": "Greet."},
    {"role": "user", "content": [{"type": "text", "text": "Bye"}]}
  ]
}"#;

/// Hugging Face's apply_chat_template on the same conversation with the real Qwen3.6 template, thinking on by
/// default (reasoning of turns before the last user message is dropped by the template).
const RENDERED: &str = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n<think>\n";

fn write_temp(text: &str) -> tempfile::NamedTempFile {
    let mut file = tempfile::Builder::new().suffix(".json").tempfile().unwrap();
    file.write_all(text.as_bytes()).unwrap();
    file
}

#[test]
fn render_prints_the_exact_prompt() {
    let file = write_temp(CONVERSATION);
    let path = file.path().to_str().unwrap();
    assert_eq!(ok(&["render", "--think", path]), RENDERED);
    let no_think = RENDERED.replace("<think>\n", "<think>\n\n</think>\n\n");
    assert_eq!(ok(&["render", "--no-think", path]), no_think);
    // The bundled model's template turns thinking off unless asked for (it was trained with empty think blocks).
    assert_eq!(ok(&["render", path]), no_think);

    // chat_template_kwargs in the body, and the body on standard input.
    let mut body: serde_json::Value = serde_json::from_str(CONVERSATION).unwrap();
    body["chat_template_kwargs"] = serde_json::json!({"enable_thinking": false});
    let output = lily_with_input(&["render", "-"], &body.to_string());
    assert!(output.status.success(), "{}", stderr(&output));
    assert_eq!(stdout(&output), no_think);

    // A finished conversation without a generation prompt keeps the last turn's reasoning.
    let finished = r#"{"messages": [{"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Add."}]}"#;
    let file = write_temp(finished);
    assert_eq!(
        ok(&["render", "--no-generation-prompt", file.path().to_str().unwrap()]),
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n<think>\nAdd.\n</think>\n\n4<|im_end|>\n"
    );

    // The prompt's token ids.
    let ids: Vec<u32> = serde_json::from_str(&ok(&["render", "--think", "--ids", path])).unwrap();
    assert_eq!(ids.first(), Some(&248045));
    assert_eq!(ids.len(), 33, "{ids:?}");
    // Without a flag the bundled template closes the think block: four more tokens (`\n`, `</think>`, `\n\n`).
    let ids: Vec<u32> = serde_json::from_str(&ok(&["render", "--ids", path])).unwrap();
    assert_eq!(ids.len(), 35, "{ids:?}");
    assert_eq!(ids[ids.len() - 2], 248069, "{ids:?}");
}

#[test]
fn render_with_tools() {
    let body = r#"{"messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]}"#;
    let file = write_temp(body);
    let prompt = ok(&["render", file.path().to_str().unwrap()]);
    assert!(prompt.starts_with("<|im_start|>system\n# Tools\n"), "{prompt}");
    assert!(
        prompt.contains(r#"{"type": "function", "function": {"name": "get_weather", "description": "Weather.""#),
        "{prompt}"
    );
    assert!(prompt
        .ends_with("<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"));
}

#[test]
fn render_refuses_bad_conversations_clearly() {
    let image = r#"{"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]}]}"#;
    let message = fails(&["render", "-"], image);
    assert!(
        message.contains("message 0: content parts of type \"image_url\" are not supported; only text parts are"),
        "{message}"
    );

    let message = fails(&["render", "-"], "{\"messages\": [");
    assert!(message.contains("standard input is not valid JSON"), "{message}");

    let message = fails(&["render", "-"], r#"{"messages": {"role": "user"}}"#);
    assert!(message.contains("\"messages\" must be a list"), "{message}");

    // The template's own raise_exception reaches the user as its message.
    let message = fails(
        &["render", "-"],
        r#"{"messages": [{"role": "system", "content": "Alone."}]}"#,
    );
    assert!(message.contains("No user query found in messages."), "{message}");

    let message = fails(&["render", "/nonexistent/conversation.json"], "");
    assert!(message.contains("/nonexistent/conversation.json"), "{message}");
}

#[test]
fn generate_chat_prints_an_answer() {
    let output = lily(&[
        "generate",
        "--chat",
        "--think",
        "--temperature",
        "0",
        "--max-tokens",
        "64",
        "--prompt",
        "What light through yonder window breaks?",
    ]);
    assert!(output.status.success(), "{}", stderr(&output));
    let answer = stdout(&output);
    assert!(answer.split_whitespace().count() >= 3, "answer: {answer:?}");
    assert!(
        !answer.contains("<|im_end|>") && !answer.contains("<think>"),
        "answer: {answer:?}"
    );
    // With thinking on, the default model writes its answer in the think block that the prompt opens and never
    // closes it: the reasoning on stderr is the same text.
    assert!(
        stderr(&output).contains(answer.trim()),
        "answer {answer:?}, stderr {:?}",
        stderr(&output)
    );
    assert!(stderr(&output).contains("prefill: "), "{}", stderr(&output));

    let output = lily(&[
        "generate",
        "--chat",
        "--temperature",
        "0",
        "--max-tokens",
        "64",
        "--prompt",
        "O Romeo, Romeo, wherefore art thou Romeo?",
    ]);
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(
        stdout(&output).split_whitespace().count() >= 2,
        "answer: {:?}",
        stdout(&output)
    );
}

#[test]
fn generate_with_a_bad_model_dir_names_it() {
    let message = fails(
        &[
            "generate",
            "--model",
            "/nonexistent/lily-model-dir",
            "--max-tokens",
            "4",
        ],
        "",
    );
    assert!(message.contains("/nonexistent/lily-model-dir"), "{message}");
    let message = fails(&["chat", "--model", "/nonexistent/lily-model-dir"], "");
    assert!(message.contains("/nonexistent/lily-model-dir"), "{message}");
    let message = fails(&["tokenize", "--model", "/nonexistent/lily-model-dir", "hi"], "");
    assert!(message.contains("/nonexistent/lily-model-dir"), "{message}");
}

#[test]
fn generate_defaults_to_the_shakespeare_model() {
    let text = ok(&["generate", "--max-tokens", "8", "--temperature", "0"]);
    assert!(text.starts_with("And in your city"), "{text:?}");
}

#[test]
fn bench_on_the_cpu_prints_a_row_per_thread_count_and_test() {
    let out = ok(&["bench", "--device", "cpu", "-p", "8", "-n", "4", "-r", "1", "-t", "1,2"]);
    let rows: Vec<&str> = out.lines().filter(|l| l.contains("lily-tiny-shakespeare")).collect();
    assert_eq!(rows.len(), 4, "{out}");
    for (row, (threads, test)) in rows.iter().zip([(1, "pp8"), (1, "tg4"), (2, "pp8"), (2, "tg4")]) {
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        assert_eq!((cells[3], cells[4]), (threads.to_string().as_str(), test), "{row}");
        let speed: f64 = cells[6].split_whitespace().next().unwrap().parse().unwrap();
        assert!(speed > 0.0, "{row}");
    }
    let err = fails(&["bench", "--device", "cpu", "-n", "4", "-r", "0"], "");
    assert!(err.contains("repetition"), "{err}");
}
