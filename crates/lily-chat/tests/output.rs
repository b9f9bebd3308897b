//! From generated tokens to client-visible output: reasoning, content, tool calls, stop conditions.

mod common;

use lily_chat::{
    Delta, FinalOutput, FinishReason, OutputOptions, OutputParser, OutputStream, ToolCall, ToolCallDelta, ToolCallIds,
};
use proptest::prelude::*;
use serde_json::{json, Value};

const THINKING_PROMPT: &str = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n";
const NO_THINKING_PROMPT: &str =
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n";
const EOS: [u32; 2] = [248046, 248044];

fn tools() -> Vec<Value> {
    vec![json!({
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "note": {"type": "string"}}
            }
        }
    })]
}

fn options(tools: Vec<Value>, stop_strings: &[&str], max_tokens: Option<usize>) -> OutputOptions {
    OutputOptions {
        eos_token_ids: EOS.to_vec(),
        stop_strings: stop_strings.iter().map(|stop| stop.to_string()).collect(),
        max_tokens,
        tools,
        call_ids: ToolCallIds::Sequential,
    }
}

/// Everything a client receives, in order, and the final output.
struct Run {
    deltas: Vec<Delta>,
    tokens_taken: usize,
    output: FinalOutput,
}

/// Encodes `generated` (model output text, special tokens written as text) and feeds it token by token.
fn run(prompt: &str, generated: &str, options: OutputOptions) -> Run {
    feed(OutputStream::new(common::tokenizer(), prompt, options), generated)
}

fn run_raw(generated: &str, options: OutputOptions) -> Run {
    feed(OutputStream::raw(common::tokenizer(), options), generated)
}

fn feed(mut stream: OutputStream, generated: &str) -> Run {
    let ids = common::tokenizer().encode(generated, false).unwrap();
    let mut deltas = Vec::new();
    let mut tokens_taken = 0;
    for id in ids {
        if stream.is_finished() {
            break;
        }
        tokens_taken += 1;
        deltas.extend(stream.push_token(id).unwrap());
    }
    let output = stream.finish().unwrap();
    deltas.extend(output.deltas.clone());
    Run {
        deltas,
        tokens_taken,
        output,
    }
}

/// Joins streamed deltas back into (reasoning, content, tool calls), checking the OpenAI delta shape.
fn join_deltas(deltas: &[Delta]) -> (String, String, Vec<ToolCall>) {
    let mut reasoning = String::new();
    let mut content = String::new();
    let mut calls: Vec<ToolCall> = Vec::new();
    for delta in deltas {
        match delta {
            Delta::Reasoning(text) => reasoning.push_str(text),
            Delta::Content(text) => content.push_str(text),
            Delta::ToolCall(ToolCallDelta {
                index,
                id: Some(id),
                name: Some(name),
                arguments,
            }) => {
                assert_eq!(*index, calls.len(), "a new call takes the next index");
                calls.push(ToolCall {
                    id: id.clone(),
                    name: name.clone(),
                    arguments: arguments.clone(),
                });
            }
            Delta::ToolCall(ToolCallDelta {
                index,
                id: None,
                name: None,
                arguments,
            }) => {
                assert_eq!(*index + 1, calls.len(), "arguments continue the latest call");
                calls[*index].arguments.push_str(arguments);
            }
            Delta::ToolCall(delta) => {
                panic!("a call delta has both id and name or neither: {delta:?}")
            }
        }
    }
    (reasoning, content, calls)
}

fn assert_deltas_match_output(run: &Run) {
    let (reasoning, content, calls) = join_deltas(&run.deltas);
    assert_eq!(reasoning, run.output.reasoning);
    assert_eq!(content, run.output.content);
    assert_eq!(calls, run.output.tool_calls);
}

fn text_pieces(deltas: &[Delta]) -> Vec<&str> {
    deltas
        .iter()
        .filter_map(|delta| match delta {
            Delta::Reasoning(text) | Delta::Content(text) => Some(text.as_str()),
            Delta::ToolCall(_) => None,
        })
        .collect()
}

#[test]
fn thinking_output_splits_into_reasoning_and_content() {
    let run = run(
        THINKING_PROMPT,
        "Two plus two.\n</think>\n\nThe answer is **4**.<|im_end|>",
        options(vec![], &[], None),
    );
    assert_eq!(run.output.reasoning, "Two plus two.\n");
    assert_eq!(run.output.content, "The answer is **4**.");
    assert!(!run.output.content_is_reasoning);
    assert_eq!(run.output.finish_reason, FinishReason::Stop);
    assert_eq!(run.output.completion_tokens, run.tokens_taken);
    assert!(matches!(run.deltas.first(), Some(Delta::Reasoning(_))));
    assert!(text_pieces(&run.deltas).iter().all(|piece| !piece.contains("think>")));
    assert_deltas_match_output(&run);
}

#[test]
fn thinking_off_gives_content_only() {
    let run = run(NO_THINKING_PROMPT, "4<|im_end|>", options(vec![], &[], None));
    assert_eq!((run.output.reasoning.as_str(), run.output.content.as_str()), ("", "4"));
    assert_eq!(run.deltas, vec![Delta::Content("4".into())]);
}

#[test]
fn tokens_after_end_of_sequence_are_ignored() {
    let tokenizer = common::tokenizer();
    let mut stream = OutputStream::new(tokenizer.clone(), NO_THINKING_PROMPT, options(vec![], &[], None));
    for id in tokenizer.encode("Hi", false).unwrap() {
        stream.push_token(id).unwrap();
    }
    assert!(stream.push_token(248044).unwrap().is_empty());
    assert!(stream.is_finished());
    assert!(stream
        .push_token(tokenizer.encode("more", false).unwrap()[0])
        .unwrap()
        .is_empty());
    let output = stream.finish().unwrap();
    assert_eq!(
        (output.content.as_str(), output.finish_reason, output.completion_tokens),
        ("Hi", FinishReason::Stop, 2)
    );
}

#[test]
fn stop_string_across_tokens_is_cut_with_what_follows() {
    let run = run(
        NO_THINKING_PROMPT,
        "The answer is **4**. Anything else?",
        options(vec![], &["is **4", "never"], None),
    );
    assert_eq!(run.output.content, "The answer ");
    assert_eq!(run.output.finish_reason, FinishReason::Stop);
    assert!(
        run.tokens_taken
            < common::tokenizer()
                .encode("The answer is **4**. Anything else?", false)
                .unwrap()
                .len()
    );
    assert_deltas_match_output(&run);
}

// --- An output that ends inside the think block the prompt opened --------------------------------------------

/// The deltas of a run that ended inside the prompt's think block: reasoning as it came, then the same text once
/// more as content, last.
fn assert_reasoning_then_the_same_content(run: &Run) {
    assert!(run.output.content_is_reasoning);
    assert!(!run.output.reasoning.is_empty());
    assert_eq!(run.output.content, run.output.reasoning);
    assert!(run.output.tool_calls.is_empty());
    let (last, streamed) = run.deltas.split_last().unwrap();
    assert_eq!(last, &Delta::Content(run.output.reasoning.clone()));
    assert!(streamed.iter().all(|delta| matches!(delta, Delta::Reasoning(_))));
    assert_deltas_match_output(run);
}

#[test]
fn answer_written_in_the_prompts_think_block_is_also_the_content() {
    // What the bundled model does with thinking on: it answers and ends its turn without ever closing the block.
    let run = run(
        THINKING_PROMPT,
        "Two and two make four, good sir.<|im_end|>",
        options(tools(), &[], None),
    );
    assert_eq!(run.output.reasoning, "Two and two make four, good sir.");
    assert_eq!(run.output.finish_reason, FinishReason::Stop);
    assert_reasoning_then_the_same_content(&run);
}

#[test]
fn max_tokens_inside_the_prompts_think_block_also_gives_the_reasoning_as_content() {
    let run = run(
        THINKING_PROMPT,
        "Let me think about this carefully.\n</think>\n\n4",
        options(vec![], &[], Some(3)),
    );
    assert_eq!(run.tokens_taken, 3);
    assert_eq!(run.output.finish_reason, FinishReason::Length);
    assert!("Let me think about".starts_with(&run.output.reasoning));
    assert_reasoning_then_the_same_content(&run);
}

#[test]
fn stop_string_inside_the_prompts_think_block_also_gives_the_reasoning_as_content() {
    let run = run(
        THINKING_PROMPT,
        "Let me think. STOP here\n</think>\n\n4<|im_end|>",
        options(vec![], &["STOP"], None),
    );
    assert_eq!(run.output.reasoning, "Let me think. ");
    assert_eq!(run.output.finish_reason, FinishReason::Stop);
    assert_reasoning_then_the_same_content(&run);
}

#[test]
fn a_closed_or_model_opened_think_block_is_never_copied_to_the_content() {
    let closed = run(
        THINKING_PROMPT,
        "Hmm.\n</think>\n\n<|im_end|>",
        options(vec![], &[], None),
    );
    assert_eq!(
        (closed.output.reasoning.as_str(), closed.output.content.as_str()),
        ("Hmm.\n", "")
    );
    assert!(!closed.output.content_is_reasoning);

    // A prompt with no think block: the model opened one itself and ended its turn inside it.
    let prompt = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n";
    let opened_by_model = run(prompt, "<think>\nStill thinking<|im_end|>", options(vec![], &[], None));
    assert_eq!(
        (
            opened_by_model.output.reasoning.as_str(),
            opened_by_model.output.content.as_str()
        ),
        ("Still thinking", "")
    );
    assert!(!opened_by_model.output.content_is_reasoning);
    assert_deltas_match_output(&opened_by_model);
}

#[test]
fn the_caller_stopping_inside_the_prompts_think_block_leaves_it_reasoning() {
    // Not an end of the generation but its abandonment (an interrupted chat answer): nothing is taken as content.
    let tokenizer = common::tokenizer();
    let mut stream = OutputStream::new(tokenizer.clone(), THINKING_PROMPT, options(vec![], &[], None));
    for id in tokenizer.encode("Half a thought", false).unwrap() {
        stream.push_token(id).unwrap();
    }
    let output = stream.finish().unwrap();
    assert_eq!(output.finish_reason, FinishReason::Length);
    assert_eq!(
        (output.reasoning.as_str(), output.content.as_str()),
        ("Half a thought", "")
    );
    assert!(!output.content_is_reasoning);
}

// --- Raw mode (the completions API) --------------------------------------------------------------------------

#[test]
fn raw_mode_is_the_text_with_special_tokens_skipped() {
    let generated = "Two plus two.\n</think>\n\n<tool_call>\nRare: 𠜎 👩‍👩‍👧<|vision_pad|>.";
    let run = run_raw(generated, options(tools(), &[], None));
    let tokenizer = common::tokenizer();
    let ids = tokenizer.encode(generated, false).unwrap();
    assert_eq!(run.output.content, tokenizer.decode(&ids, true).unwrap());
    assert_eq!(run.output.content, "Two plus two.\n\n\n\nRare: 𠜎 👩‍👩‍👧.");
    assert_eq!(run.output.reasoning, "");
    assert!(run.output.tool_calls.is_empty() && !run.output.content_is_reasoning);
    // Cut by the caller, not by an end-of-sequence token.
    assert_eq!(run.output.finish_reason, FinishReason::Length);
    assert_eq!(run.output.completion_tokens, ids.len());
    assert!(run
        .deltas
        .iter()
        .all(|delta| matches!(delta, Delta::Content(text) if !text.contains(char::REPLACEMENT_CHARACTER))));
    assert_deltas_match_output(&run);
}

#[test]
fn raw_mode_stops_like_chat() {
    let run = run_raw(
        "ROMEO. But soft! What light<|im_end|>",
        options(vec![], &["soft! W"], None),
    );
    assert_eq!(
        (run.output.content.as_str(), run.output.finish_reason),
        ("ROMEO. But ", FinishReason::Stop)
    );
    assert_deltas_match_output(&run);

    let run = run_raw("ROMEO. But soft!<|im_end|>", options(vec![], &[], None));
    assert_eq!(
        (run.output.content.as_str(), run.output.finish_reason),
        ("ROMEO. But soft!", FinishReason::Stop)
    );

    let run = run_raw("ROMEO. But soft!", options(vec![], &[], Some(2)));
    assert_eq!(run.tokens_taken, 2);
    assert_eq!(run.output.finish_reason, FinishReason::Length);
    assert!("ROMEO. But soft!".starts_with(&run.output.content) && !run.output.content.is_empty());
}

#[test]
fn tool_calls_stream_as_openai_deltas() {
    let generated = "Checking.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nLima\n</parameter>\n</function>\n</tool_call><|im_end|>";
    let run = run(NO_THINKING_PROMPT, generated, options(tools(), &[], None));
    assert_eq!(run.output.content, "Checking.");
    assert_eq!(
        run.output.tool_calls,
        vec![
            ToolCall {
                id: "call_0".into(),
                name: "get_weather".into(),
                arguments: r#"{"city":"Paris","days":2}"#.into()
            },
            ToolCall {
                id: "call_1".into(),
                name: "get_weather".into(),
                arguments: r#"{"city":"Lima"}"#.into()
            },
        ]
    );
    assert_eq!(run.output.finish_reason, FinishReason::ToolCalls);
    let first_call_delta = run
        .deltas
        .iter()
        .find(|delta| matches!(delta, Delta::ToolCall(_)))
        .unwrap();
    assert_eq!(
        first_call_delta,
        &Delta::ToolCall(ToolCallDelta {
            index: 0,
            id: Some("call_0".into()),
            name: Some("get_weather".into()),
            arguments: String::new()
        })
    );
    assert!(
        text_pieces(&run.deltas).iter().all(|piece| !piece.contains('<')),
        "no markup reaches the client"
    );
    assert_deltas_match_output(&run);
}

#[test]
fn tool_calls_after_reasoning() {
    let generated = "Need the weather.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>";
    let run = run(THINKING_PROMPT, generated, options(tools(), &[], None));
    assert_eq!(run.output.reasoning, "Need the weather.\n");
    assert_eq!(run.output.content, "");
    assert_eq!(run.output.tool_calls.len(), 1);
    // The caller ended generation without an end-of-sequence token: that counts as running out of length.
    assert_eq!(run.output.finish_reason, FinishReason::Length);
}

#[test]
fn without_tools_tool_markup_is_content() {
    let generated = "<tool_call>\n<function=get_weather>\n</function>\n</tool_call><|im_end|>";
    let run = run(NO_THINKING_PROMPT, generated, options(vec![], &[], None));
    assert_eq!(
        run.output.content,
        "<tool_call>\n<function=get_weather>\n</function>\n</tool_call>"
    );
    assert!(run.output.tool_calls.is_empty());
    assert_eq!(run.output.finish_reason, FinishReason::Stop);
}

#[test]
fn unfinished_tool_call_cut_by_max_tokens_is_content() {
    let generated = "Sure.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nBuenos Aires and more text";
    let run = run(NO_THINKING_PROMPT, generated, options(tools(), &[], Some(12)));
    assert_eq!(run.output.finish_reason, FinishReason::Length);
    assert!(run.output.tool_calls.is_empty());
    assert!(
        run.output
            .content
            .starts_with("Sure.\n\n<tool_call>\n<function=get_weather>"),
        "{:?}",
        run.output.content
    );
    assert_deltas_match_output(&run);
}

#[test]
fn other_special_tokens_are_not_shown() {
    let run = run(
        NO_THINKING_PROMPT,
        "A<|im_start|>B<|vision_pad|>C<|im_end|>",
        options(vec![], &[], None),
    );
    assert_eq!(run.output.content, "ABC");
    assert_eq!(run.output.completion_tokens, 6);
}

#[test]
fn characters_split_across_tokens_arrive_whole() {
    let run = run(
        NO_THINKING_PROMPT,
        "Rare: 𠜎𠜱 and emoji 👩‍👩‍👧.",
        options(vec![], &[], None),
    );
    assert_eq!(run.output.content, "Rare: 𠜎𠜱 and emoji 👩‍👩‍👧.");
    assert!(text_pieces(&run.deltas)
        .iter()
        .all(|piece| !piece.contains(char::REPLACEMENT_CHARACTER)));
}

// --- Property tests: chunking never changes the result -------------------------------------------------------

/// Whole-output parse as the reference.
fn parse_whole(prompt: &str, text: &str, tools: &[Value]) -> (String, String, Vec<ToolCall>) {
    parse_chunks(prompt, &[text], tools)
}

fn parse_chunks(prompt: &str, chunks: &[&str], tools: &[Value]) -> (String, String, Vec<ToolCall>) {
    let mut parser = OutputParser::new(prompt, tools, ToolCallIds::Sequential);
    let mut deltas = Vec::new();
    for chunk in chunks {
        deltas.extend(parser.push_text(chunk));
    }
    deltas.extend(parser.finish());
    let joined = join_deltas(&deltas);
    assert_eq!(
        joined,
        (
            parser.reasoning().to_string(),
            parser.content().to_string(),
            parser.tool_calls().to_vec()
        )
    );
    joined
}

/// Cuts `text` at the given fractions of its length (moved down to char boundaries).
fn split_at_fractions<'a>(text: &'a str, cuts: &[f64]) -> Vec<&'a str> {
    let mut positions: Vec<usize> = cuts
        .iter()
        .map(|cut| {
            let mut position = (text.len() as f64 * cut) as usize;
            while !text.is_char_boundary(position) {
                position -= 1;
            }
            position
        })
        .collect();
    positions.sort_unstable();
    let mut chunks = Vec::new();
    let mut start = 0;
    for position in positions.into_iter().chain([text.len()]) {
        chunks.push(&text[start..position]);
        start = position;
    }
    chunks
}

const TAGS: [&str; 8] = [
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<function=",
    "</function>",
    "<parameter=",
    "</parameter>",
];

/// Text with the characters tags are made of, but no whole tag; no whitespace at either end.
fn free_text() -> impl Strategy<Value = String> {
    "([a-z<>/=_é😀中]([a-z <>/=_\n.é😀中]{0,24}[a-z<>/=_é😀中])?)?"
        .prop_filter("no whole tags", |text| TAGS.iter().all(|tag| !text.contains(tag)))
}

#[derive(Debug, Clone)]
struct GeneratedCall {
    city: String,
    days: Option<i64>,
    note: Option<String>,
}

fn generated_call() -> impl Strategy<Value = GeneratedCall> {
    (
        "[A-Za-z][A-Za-z ]{0,12}",
        proptest::option::of(any::<i64>()),
        proptest::option::of(free_text()),
    )
        .prop_map(|(city, days, note)| GeneratedCall { city, days, note })
}

/// A well-formed model output with the pieces it is made of.
#[derive(Debug, Clone)]
struct ValidOutput {
    thinking: bool,
    reasoning: String,
    content: String,
    calls: Vec<GeneratedCall>,
}

impl ValidOutput {
    fn prompt(&self) -> &'static str {
        if self.thinking {
            THINKING_PROMPT
        } else {
            NO_THINKING_PROMPT
        }
    }

    fn text(&self) -> String {
        let mut text = String::new();
        if self.thinking {
            text.push_str(&format!("{}\n</think>\n\n", self.reasoning));
        }
        text.push_str(&self.content);
        for call in &self.calls {
            text.push_str("\n\n<tool_call>\n<function=get_weather>\n");
            text.push_str(&format!("<parameter=city>\n{}\n</parameter>\n", call.city));
            if let Some(days) = call.days {
                text.push_str(&format!("<parameter=days>\n{days}\n</parameter>\n"));
            }
            if let Some(note) = &call.note {
                text.push_str(&format!("<parameter=note>\n{note}\n</parameter>\n"));
            }
            text.push_str("</function>\n</tool_call>");
        }
        text
    }

    fn expected(&self) -> (String, String, Vec<ToolCall>) {
        let reasoning = if self.thinking {
            format!("{}\n", self.reasoning)
        } else {
            String::new()
        };
        let calls = self
            .calls
            .iter()
            .enumerate()
            .map(|(index, call)| {
                let mut arguments = serde_json::Map::new();
                arguments.insert("city".into(), json!(call.city));
                if let Some(days) = call.days {
                    arguments.insert("days".into(), json!(days));
                }
                if let Some(note) = &call.note {
                    arguments.insert("note".into(), json!(note));
                }
                ToolCall {
                    id: format!("call_{index}"),
                    name: "get_weather".into(),
                    arguments: Value::Object(arguments).to_string(),
                }
            })
            .collect();
        (reasoning, self.content.clone(), calls)
    }
}

fn valid_output() -> impl Strategy<Value = ValidOutput> {
    (
        any::<bool>(),
        free_text(),
        free_text(),
        proptest::collection::vec(generated_call(), 0..3),
    )
        .prop_map(|(thinking, reasoning, content, calls)| ValidOutput {
            thinking,
            reasoning,
            content,
            calls,
        })
}

/// Arbitrary mixes of tags, tag fragments and text: any result is fine, but it must not depend on chunking.
fn tag_soup() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        Just("<think>".to_string()),
        Just("</think>".to_string()),
        Just("<tool_call>".to_string()),
        Just("</tool_call>".to_string()),
        Just("<function=get_weather>".to_string()),
        Just("</function>".to_string()),
        Just("<parameter=city>".to_string()),
        Just("<parameter=days>".to_string()),
        Just("</parameter>".to_string()),
        Just("{\"name\": \"f\", \"arguments\": {}}".to_string()),
        "[a-z <>/=\n{}\"é😀]{1,6}",
    ];
    proptest::collection::vec(piece, 0..24).prop_map(|pieces| pieces.concat())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn valid_output_parses_to_its_parts_however_it_is_chunked(
        output in valid_output(),
        cuts in proptest::collection::vec(0.0..1.0f64, 0..12),
    ) {
        let text = output.text();
        let whole = parse_whole(output.prompt(), &text, &tools());
        prop_assert_eq!(&whole, &output.expected());
        let chunks = split_at_fractions(&text, &cuts);
        prop_assert_eq!(parse_chunks(output.prompt(), &chunks, &tools()), whole);
    }

    #[test]
    fn any_text_parses_the_same_however_it_is_chunked(
        text in tag_soup(),
        thinking in any::<bool>(),
        with_tools in any::<bool>(),
        cuts in proptest::collection::vec(0.0..1.0f64, 0..12),
    ) {
        let prompt = if thinking { THINKING_PROMPT } else { NO_THINKING_PROMPT };
        let tools = if with_tools { tools() } else { vec![] };
        let whole = parse_whole(prompt, &text, &tools);
        let chunks = split_at_fractions(&text, &cuts);
        prop_assert_eq!(parse_chunks(prompt, &chunks, &tools), whole);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(100))]

    #[test]
    fn token_stream_gives_the_whole_text_result(output in valid_output(), stop in "[a-z]{2,3}") {
        let text = output.text();
        let run = run(output.prompt(), &format!("{text}<|im_end|>"), options(tools(), &[], None));
        let (reasoning, content, calls) = output.expected();
        prop_assert_eq!(&run.output.reasoning, &reasoning);
        prop_assert_eq!(&run.output.content, &content);
        prop_assert_eq!(&run.output.tool_calls, &calls);
        let finish = if calls.is_empty() { FinishReason::Stop } else { FinishReason::ToolCalls };
        prop_assert_eq!(run.output.finish_reason, finish);
        assert_deltas_match_output(&run);

        // With a stop string the output is the text before its first occurrence, parsed; cut inside the prompt's
        // think block, that reasoning is the content too.
        let run = run_with_stop(output.prompt(), &text, &stop);
        let shown = text.find(&stop).map_or(text.as_str(), |position| &text[..position]);
        let (reasoning, mut content, calls) = parse_whole(output.prompt(), shown, &tools());
        let cut_while_thinking = output.thinking && !shown.contains("</think>");
        if cut_while_thinking {
            content = reasoning.clone();
        }
        prop_assert_eq!(run.output.content_is_reasoning, cut_while_thinking);
        prop_assert_eq!((run.output.reasoning.clone(), run.output.content.clone(), run.output.tool_calls.clone()), (reasoning, content, calls));
        assert_deltas_match_output(&run);
    }
}

fn run_with_stop(prompt: &str, text: &str, stop: &str) -> Run {
    run(prompt, text, options(tools(), &[stop], None))
}
