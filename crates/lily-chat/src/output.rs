//! The whole path from generated token ids to what a client sees: detokenize, stop conditions, reasoning split,
//! tool calls. Used alike by the HTTP server (streamed or not) and the interactive chat; the completions API uses
//! its raw mode, which only detokenizes and applies the stop conditions.

use std::sync::Arc;

use serde_json::Value as Json;

use crate::reasoning::{ReasoningParser, TextSegment};
use crate::stop::{FinishReason, StopChecker, TokenCheck};
use crate::stream_decoder::StreamDecoder;
use crate::tokenizer::{Tokenizer, TokenizerError};
use crate::tool_call::{ToolCall, ToolCallEvent, ToolCallIds, ToolCallParser};

/// One piece of streamed output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Delta {
    Reasoning(String),
    Content(String),
    ToolCall(ToolCallDelta),
}

/// A piece of a tool call in the OpenAI streaming shape (type is always "function"). The first delta of a call
/// has its `id` and `name` and empty `arguments`; the next ones carry argument text, which concatenated is the
/// call's JSON arguments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCallDelta {
    pub index: usize,
    pub id: Option<String>,
    pub name: Option<String>,
    pub arguments: String,
}

/// Text-level parsing of generated output: reasoning versus content, then tool calls in the content.
#[derive(Debug)]
pub struct OutputParser {
    reasoning: ReasoningParser,
    /// The prompt opened a think block: the output starts inside it.
    prompt_opened_think: bool,
    /// None when the request has no tools: tool-call markup is then plain content.
    tool_calls: Option<ToolCallParser>,
    reasoning_text: String,
    content_text: String,
    calls: Vec<ToolCall>,
}

impl OutputParser {
    /// `prompt_text` is the rendered prompt (its end says whether output starts inside a think block);
    /// `tools` the request's tool definitions (empty: no tool-call parsing).
    pub fn new(prompt_text: &str, tools: &[Json], call_ids: ToolCallIds) -> Self {
        let reasoning = ReasoningParser::for_prompt(prompt_text);
        Self {
            prompt_opened_think: reasoning.in_reasoning(),
            reasoning,
            tool_calls: (!tools.is_empty()).then(|| ToolCallParser::new(tools, call_ids)),
            reasoning_text: String::new(),
            content_text: String::new(),
            calls: Vec::new(),
        }
    }

    /// For raw text (the completions API): no reasoning split and no tool calls; all of it is content.
    pub fn raw() -> Self {
        Self {
            reasoning: ReasoningParser::content_only(),
            prompt_opened_think: false,
            tool_calls: None,
            reasoning_text: String::new(),
            content_text: String::new(),
            calls: Vec::new(),
        }
    }

    /// Whether the output is inside a think block now.
    pub fn in_reasoning(&self) -> bool {
        self.reasoning.in_reasoning()
    }

    pub fn push_text(&mut self, text: &str) -> Vec<Delta> {
        let segments = self.reasoning.push(text);
        self.route(segments)
    }

    /// End of output: everything held back is released as what it turned out to be.
    pub fn finish(&mut self) -> Vec<Delta> {
        let segments = self.reasoning.finish();
        let mut deltas = self.route(segments);
        if let Some(parser) = &mut self.tool_calls {
            let events = parser.finish();
            self.emit_tool_events(events, &mut deltas);
        }
        deltas
    }

    pub fn reasoning(&self) -> &str {
        &self.reasoning_text
    }

    pub fn content(&self) -> &str {
        &self.content_text
    }

    pub fn tool_calls(&self) -> &[ToolCall] {
        &self.calls
    }

    /// The output so far is all inside the think block that the prompt opened.
    fn in_prompts_think_block(&self) -> bool {
        self.prompt_opened_think && self.reasoning.in_reasoning()
    }

    fn route(&mut self, segments: Vec<TextSegment>) -> Vec<Delta> {
        let mut deltas = Vec::new();
        for segment in segments {
            match segment {
                TextSegment::Reasoning(text) => {
                    self.reasoning_text.push_str(&text);
                    push_text_delta(&mut deltas, Delta::Reasoning(text));
                }
                TextSegment::Content(text) => match &mut self.tool_calls {
                    Some(parser) => {
                        let events = parser.push(&text);
                        self.emit_tool_events(events, &mut deltas);
                    }
                    None => {
                        self.content_text.push_str(&text);
                        push_text_delta(&mut deltas, Delta::Content(text));
                    }
                },
            }
        }
        deltas
    }

    fn emit_tool_events(&mut self, events: Vec<ToolCallEvent>, deltas: &mut Vec<Delta>) {
        for event in events {
            match event {
                ToolCallEvent::Content(text) => {
                    self.content_text.push_str(&text);
                    push_text_delta(deltas, Delta::Content(text));
                }
                ToolCallEvent::Call(call) => {
                    let index = self.calls.len();
                    deltas.push(Delta::ToolCall(ToolCallDelta {
                        index,
                        id: Some(call.id.clone()),
                        name: Some(call.name.clone()),
                        arguments: String::new(),
                    }));
                    deltas.push(Delta::ToolCall(ToolCallDelta {
                        index,
                        id: None,
                        name: None,
                        arguments: call.arguments.clone(),
                    }));
                    self.calls.push(call);
                }
            }
        }
    }
}

/// Appends a text delta, joined onto the previous one when of the same kind; empty text is dropped.
fn push_text_delta(deltas: &mut Vec<Delta>, delta: Delta) {
    match (deltas.last_mut(), delta) {
        (_, Delta::Reasoning(text) | Delta::Content(text)) if text.is_empty() => {}
        (Some(Delta::Reasoning(last)), Delta::Reasoning(text)) | (Some(Delta::Content(last)), Delta::Content(text)) => {
            last.push_str(&text)
        }
        (_, delta) => deltas.push(delta),
    }
}

/// What a generation needs besides its prompt.
#[derive(Debug, Clone, Default)]
pub struct OutputOptions {
    /// End-of-sequence ids from the model config (for this family 248046 and 248044).
    pub eos_token_ids: Vec<u32>,
    /// User stop strings, matched in the generated text (reasoning included).
    pub stop_strings: Vec<String>,
    pub max_tokens: Option<usize>,
    /// The request's tool definitions; empty: tool-call markup is plain content.
    pub tools: Vec<Json>,
    pub call_ids: ToolCallIds,
}

/// The end of a generation: the last deltas to stream, and the whole output (which the streamed deltas, joined,
/// add up to).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FinalOutput {
    /// Text that was held back until the end; send these before the final chunk.
    pub deltas: Vec<Delta>,
    pub reasoning: String,
    pub content: String,
    /// The generation ended (not stopped by the caller) inside the think block that the prompt opened: `content`
    /// is a copy of `reasoning`, sent as the last delta (see [`OutputStream::finish`]).
    pub content_is_reasoning: bool,
    pub tool_calls: Vec<ToolCall>,
    pub finish_reason: FinishReason,
    /// Tokens generated, end-of-sequence token included.
    pub completion_tokens: usize,
    /// Of those, the tokens of the think block, its tags included (OpenAI's `reasoning_tokens`).
    pub reasoning_tokens: usize,
}

/// Generated token ids in, client-visible deltas out.
///
/// ```text
/// let mut output = OutputStream::new(tokenizer.clone(), &prompt, options);
/// while !output.is_finished() {
///     for delta in output.push_token(engine.next_token())? { send(delta) }
/// }
/// let last = output.finish()?;
/// ```
pub struct OutputStream {
    tokenizer: Arc<Tokenizer>,
    decoder: StreamDecoder,
    stop: StopChecker,
    parser: OutputParser,
    /// The special tokens that are shown: the think and tool-call tags that the parsers read (none in raw mode).
    shown_special_ids: Vec<u32>,
    /// Set once generation must end; `None` while it goes on.
    stop_reason: Option<FinishReason>,
    stopped_by_string: bool,
    /// Tokens taken inside a think block (or opening one).
    reasoning_tokens: usize,
    think_start: u32,
}

impl OutputStream {
    pub fn new(tokenizer: Arc<Tokenizer>, prompt_text: &str, options: OutputOptions) -> Self {
        let special = tokenizer.special();
        let shown_special_ids = vec![
            special.think_start,
            special.think_end,
            special.tool_call_start,
            special.tool_call_end,
        ];
        let parser = OutputParser::new(prompt_text, &options.tools, options.call_ids);
        Self::with_parser(tokenizer, parser, shown_special_ids, options)
    }

    /// Raw mode, for plain text completion: streaming detokenization and the stop conditions only. Special tokens
    /// are not shown, and all the text is content: no reasoning split, no tool calls (`options.tools` is not
    /// used).
    pub fn raw(tokenizer: Arc<Tokenizer>, options: OutputOptions) -> Self {
        Self::with_parser(tokenizer, OutputParser::raw(), Vec::new(), options)
    }

    fn with_parser(
        tokenizer: Arc<Tokenizer>,
        parser: OutputParser,
        shown_special_ids: Vec<u32>,
        options: OutputOptions,
    ) -> Self {
        let think_start = tokenizer.special().think_start;
        Self {
            decoder: StreamDecoder::new(tokenizer.clone(), false),
            tokenizer,
            stop: StopChecker::new(options.eos_token_ids, options.stop_strings, options.max_tokens),
            parser,
            shown_special_ids,
            stop_reason: None,
            stopped_by_string: false,
            reasoning_tokens: 0,
            think_start,
        }
    }

    /// Takes the next generated token. After the generation has finished (see [`Self::is_finished`]) further
    /// tokens are ignored.
    pub fn push_token(&mut self, id: u32) -> Result<Vec<Delta>, TokenizerError> {
        if self.stop_reason.is_some() {
            return Ok(Vec::new());
        }
        let check = self.stop.check_token(id);
        if check == TokenCheck::EndOfSequence {
            self.stop_reason = Some(FinishReason::Stop);
            return Ok(Vec::new());
        }
        // The parser has read every token before this one (a think tag is never split over held bytes), so its
        // state says whether this token lies inside a think block; `</think>` still does, `<think>` opens one.
        if self.parser.in_reasoning() || id == self.think_start {
            self.reasoning_tokens += 1;
        }
        if check == TokenCheck::MaxTokensReached {
            self.stop_reason = Some(FinishReason::Length);
        }
        if !self.is_shown(id) {
            return Ok(Vec::new());
        }
        let text = self.decoder.push(id)?;
        let scan = self.stop.scan_text(&text);
        if scan.stopped {
            self.stop_reason = Some(FinishReason::Stop);
            self.stopped_by_string = true;
        }
        Ok(self.parser.push_text(&scan.text))
    }

    /// Whether `id`, taken as the next token, would end the generation (see [`StopChecker::would_end`]), or it has
    /// ended already.
    pub fn would_end(&self, id: u32) -> bool {
        self.stop_reason.is_some() || self.stop.would_end(id)
    }

    /// True once an end-of-sequence token, a stop string or the token budget has ended the generation.
    pub fn is_finished(&self) -> bool {
        self.stop_reason.is_some()
    }

    /// Ends the output, whether it finished or the caller stopped generating (then the reason is `Length`).
    /// The finish reason is `ToolCalls` when the generation stopped normally after tool calls.
    ///
    /// A generation that ended (end of sequence, stop string or token budget, not the caller stopping it) inside
    /// the think block that the prompt opened gives its reasoning as the content too: see
    /// [`FinalOutput::content_is_reasoning`].
    pub fn finish(mut self) -> Result<FinalOutput, TokenizerError> {
        let mut deltas = Vec::new();
        if !self.stopped_by_string {
            let decoded = self.decoder.flush()?;
            let scan = self.stop.scan_text(&decoded);
            deltas.extend(self.parser.push_text(&scan.text));
            if scan.stopped {
                self.stop_reason = Some(FinishReason::Stop);
            } else {
                let held = self.stop.flush_text();
                deltas.extend(self.parser.push_text(&held));
            }
        }
        deltas.extend(self.parser.finish());
        let content_is_reasoning = self.stop_reason.is_some() && self.parser.in_prompts_think_block();
        if content_is_reasoning {
            // Nothing came after the think block: no content, no tool calls. Models trained with empty think
            // blocks (the bundled one) write their answer there and never close it; as reasoning only, that answer
            // is lost to every client that reads just `content`. It stays reasoning as well, because it has been
            // streamed as reasoning deltas already: streamed or not, a client ends up with the same output. A
            // generation that the caller abandoned (an interrupted chat answer) gave no answer: it stays as it was.
            self.parser.content_text = self.parser.reasoning_text.clone();
            push_text_delta(&mut deltas, Delta::Content(self.parser.content_text.clone()));
        }
        let finish_reason = match self.stop_reason {
            Some(FinishReason::Stop) if !self.parser.tool_calls().is_empty() => FinishReason::ToolCalls,
            Some(reason) => reason,
            None => FinishReason::Length,
        };
        Ok(FinalOutput {
            deltas,
            reasoning: self.parser.reasoning_text,
            content: self.parser.content_text,
            content_is_reasoning,
            tool_calls: self.parser.calls,
            finish_reason,
            completion_tokens: self.stop.generated_tokens(),
            reasoning_tokens: self.reasoning_tokens,
        })
    }

    fn is_shown(&self, id: u32) -> bool {
        !self.tokenizer.is_special(id) || self.shown_special_ids.contains(&id)
    }
}
