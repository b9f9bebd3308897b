//! Splits generated text into reasoning (inside `<think>...</think>`) and content.
//!
//! With thinking on, this family's generation prompt ends in `<|im_start|>assistant\n<think>\n`, so the output
//! starts inside the think block and holds only its closing `</think>`. With thinking off the prompt already holds
//! a closed, empty block and the output is all content.

use crate::partial_match::partial_suffix_len;

const THINK_START: &str = "<think>";
const THINK_END: &str = "</think>";

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TextSegment {
    Reasoning(String),
    Content(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Reasoning,
    Content,
    /// Nothing but whitespace generated yet, and the prompt opened no think block: the model may open one itself.
    ContentUnlessThinkOpens,
}

#[derive(Debug, Clone)]
pub struct ReasoningParser {
    state: State,
    /// Newlines right after a think tag are layout, as the chat template writes them, not text.
    skip_leading_newlines: bool,
    /// Text that may be the start of a tag, not emitted yet.
    held_text: String,
}

impl ReasoningParser {
    /// The start state follows from the prompt's final assistant turn: an open `<think>` there starts in reasoning;
    /// a closed `<think>...</think>` starts in content; a turn with no think block starts in content, but an
    /// output that opens with `<think>` switches to reasoning.
    pub fn for_prompt(prompt: &str) -> Self {
        let final_turn = prompt.rfind("<|im_start|>").map_or(prompt, |start| &prompt[start..]);
        if !final_turn.starts_with("<|im_start|>assistant") {
            return Self {
                state: State::ContentUnlessThinkOpens,
                skip_leading_newlines: false,
                held_text: String::new(),
            };
        }
        let last_open = final_turn.rfind(THINK_START);
        let last_close = final_turn.rfind(THINK_END);
        let state = match (last_open, last_close) {
            (Some(open), Some(close)) if open > close => State::Reasoning,
            (Some(_), None) => State::Reasoning,
            (_, Some(_)) => State::Content,
            (None, None) => State::ContentUnlessThinkOpens,
        };
        Self {
            state,
            skip_leading_newlines: false,
            held_text: String::new(),
        }
    }

    /// For text that has no think blocks (raw completions): all of it is content, tags included.
    pub fn content_only() -> Self {
        Self {
            state: State::Content,
            skip_leading_newlines: false,
            held_text: String::new(),
        }
    }

    pub fn in_reasoning(&self) -> bool {
        self.state == State::Reasoning
    }

    pub fn push(&mut self, text: &str) -> Vec<TextSegment> {
        self.held_text.push_str(text);
        let mut segments = Vec::new();
        loop {
            if self.skip_leading_newlines {
                let trimmed = self.held_text.trim_start_matches('\n');
                if trimmed.is_empty() {
                    self.held_text.clear();
                    break;
                }
                self.held_text.drain(..self.held_text.len() - trimmed.len());
                self.skip_leading_newlines = false;
            }
            match self.state {
                State::Reasoning => {
                    if let Some(position) = self.held_text.find(THINK_END) {
                        let rest = self.held_text.split_off(position + THINK_END.len());
                        self.held_text.truncate(position);
                        push_segment(
                            &mut segments,
                            TextSegment::Reasoning(std::mem::replace(&mut self.held_text, rest)),
                        );
                        self.state = State::Content;
                        self.skip_leading_newlines = true;
                        continue;
                    }
                    let keep = partial_suffix_len(&self.held_text, &[THINK_END]);
                    let held = self.held_text.split_off(self.held_text.len() - keep);
                    push_segment(
                        &mut segments,
                        TextSegment::Reasoning(std::mem::replace(&mut self.held_text, held)),
                    );
                    break;
                }
                State::ContentUnlessThinkOpens => {
                    let trimmed = self.held_text.trim_start();
                    if let Some(after_tag) = trimmed.strip_prefix(THINK_START) {
                        self.held_text = after_tag.to_string();
                        self.state = State::Reasoning;
                        self.skip_leading_newlines = true;
                        continue;
                    }
                    if trimmed.is_empty() || THINK_START.starts_with(trimmed) {
                        break;
                    }
                    self.state = State::Content;
                }
                State::Content => {
                    push_segment(&mut segments, TextSegment::Content(std::mem::take(&mut self.held_text)));
                    break;
                }
            }
        }
        segments
    }

    /// End of generation: held text is emitted as what it was (output cut off before `</think>` stays reasoning).
    pub fn finish(&mut self) -> Vec<TextSegment> {
        let held = std::mem::take(&mut self.held_text);
        let mut segments = Vec::new();
        match self.state {
            State::Reasoning => push_segment(&mut segments, TextSegment::Reasoning(held)),
            State::Content | State::ContentUnlessThinkOpens => push_segment(&mut segments, TextSegment::Content(held)),
        }
        segments
    }
}

fn push_segment(segments: &mut Vec<TextSegment>, segment: TextSegment) {
    let (TextSegment::Reasoning(text) | TextSegment::Content(text)) = &segment;
    if !text.is_empty() {
        segments.push(segment);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use TextSegment::{Content, Reasoning};

    const THINKING_PROMPT: &str = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n";
    const NO_THINKING_PROMPT: &str = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n";

    fn parse(prompt: &str, chunks: &[&str]) -> Vec<TextSegment> {
        let mut parser = ReasoningParser::for_prompt(prompt);
        let mut segments: Vec<TextSegment> = chunks.iter().flat_map(|chunk| parser.push(chunk)).collect();
        segments.extend(parser.finish());
        // Join neighbours of the same kind, so results can be compared independently of chunking.
        let mut joined: Vec<TextSegment> = Vec::new();
        for segment in segments {
            match (joined.last_mut(), segment) {
                (Some(Reasoning(a)), Reasoning(b)) | (Some(Content(a)), Content(b)) => a.push_str(&b),
                (_, segment) => joined.push(segment),
            }
        }
        joined
    }

    #[test]
    fn start_state_follows_the_prompt() {
        assert!(ReasoningParser::for_prompt(THINKING_PROMPT).in_reasoning());
        assert!(!ReasoningParser::for_prompt(NO_THINKING_PROMPT).in_reasoning());
        let history = "<|im_start|>assistant\n<think>\nold\n</think>\n\nx<|im_end|>\n<|im_start|>user\n<think><|im_end|>\n<|im_start|>assistant\n";
        assert!(!ReasoningParser::for_prompt(history).in_reasoning());
        let no_generation_prompt = "<|im_start|>user\nWhat is <think>?<|im_end|>\n";
        assert!(!ReasoningParser::for_prompt(no_generation_prompt).in_reasoning());
    }

    #[test]
    fn close_tag_switches_to_content() {
        let expected = vec![Reasoning("Let me think.\n".into()), Content("The answer.".into())];
        assert_eq!(
            parse(THINKING_PROMPT, &["Let me think.\n</think>\n\nThe answer."]),
            expected
        );
        assert_eq!(
            parse(
                THINKING_PROMPT,
                &["Let me think.\n</", "thi", "nk>", "\n", "\nThe", " answer."]
            ),
            expected
        );
    }

    #[test]
    fn a_partial_close_tag_is_never_emitted() {
        let mut parser = ReasoningParser::for_prompt(THINKING_PROMPT);
        assert_eq!(parser.push("abc</th"), vec![Reasoning("abc".into())]);
        assert_eq!(parser.push("ink"), vec![]);
        assert_eq!(parser.push(">ok"), vec![Content("ok".into())]);
    }

    #[test]
    fn cut_off_output_stays_reasoning() {
        assert_eq!(
            parse(THINKING_PROMPT, &["still thinking </thi"]),
            vec![Reasoning("still thinking </thi".into())]
        );
    }

    #[test]
    fn content_only_parser_passes_tags_through() {
        let mut parser = ReasoningParser::content_only();
        assert!(!parser.in_reasoning());
        let mut segments = parser.push("<think>\nx</th");
        segments.extend(parser.push("ink>\n"));
        segments.extend(parser.finish());
        assert_eq!(
            segments,
            vec![Content("<think>\nx</th".into()), Content("ink>\n".into())]
        );
    }

    #[test]
    fn closed_prompt_gives_content_only() {
        assert_eq!(
            parse(NO_THINKING_PROMPT, &["<think>x</think>y"]),
            vec![Content("<think>x</think>y".into())]
        );
    }

    #[test]
    fn model_may_open_think_itself_when_the_prompt_did_not() {
        let prompt = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n";
        assert_eq!(
            parse(prompt, &["<thi", "nk>\nhmm</think>\n\nyes"]),
            vec![Reasoning("hmm".into()), Content("yes".into())]
        );
        assert_eq!(parse(prompt, &["\n<thx"]), vec![Content("\n<thx".into())]);
        assert_eq!(parse(prompt, &["hello <think>"]), vec![Content("hello <think>".into())]);
    }
}
