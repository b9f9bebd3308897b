//! When generation ends: an end-of-sequence token, a user stop string in the generated text, or max tokens.

use crate::partial_match::partial_suffix_len;

/// Why a generation ended, as the OpenAI API names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token or a stop string.
    Stop,
    /// The token budget ran out (or the caller ended generation before a stop).
    Length,
    /// Stopped normally after emitting tool calls.
    ToolCalls,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::ToolCalls => "tool_calls",
        }
    }
}

/// What a generated token means for the generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenCheck {
    Continue,
    /// An end-of-sequence id: generation stops and the token is not part of the output.
    EndOfSequence,
    /// The token is part of the output and is the last one allowed.
    MaxTokensReached,
}

/// Text that may be shown after scanning for stop strings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StopScan {
    pub text: String,
    /// A stop string matched: `text` ends right before it and generation stops.
    pub stopped: bool,
}

#[derive(Debug, Clone)]
pub struct StopChecker {
    eos_token_ids: Vec<u32>,
    stop_strings: Vec<String>,
    max_tokens: Option<usize>,
    generated_tokens: usize,
    /// Text that could be the start of a stop string, not shown yet.
    held_text: String,
    stopped_by_string: bool,
}

impl StopChecker {
    /// `eos_token_ids` come from the model's config (for this family 248046 `<|im_end|>` and 248044
    /// `<|endoftext|>`). Empty stop strings are ignored.
    pub fn new(eos_token_ids: Vec<u32>, stop_strings: Vec<String>, max_tokens: Option<usize>) -> Self {
        let stop_strings = stop_strings.into_iter().filter(|stop| !stop.is_empty()).collect();
        Self {
            eos_token_ids,
            stop_strings,
            max_tokens,
            generated_tokens: 0,
            held_text: String::new(),
            stopped_by_string: false,
        }
    }

    /// Counts a generated token and says whether generation ends with it.
    pub fn check_token(&mut self, id: u32) -> TokenCheck {
        self.generated_tokens += 1;
        if self.eos_token_ids.contains(&id) {
            TokenCheck::EndOfSequence
        } else if self.max_tokens.is_some_and(|max| self.generated_tokens >= max) {
            TokenCheck::MaxTokensReached
        } else {
            TokenCheck::Continue
        }
    }

    /// Tokens counted so far, end-of-sequence tokens included.
    pub fn generated_tokens(&self) -> usize {
        self.generated_tokens
    }

    /// Whether `id`, taken as the next token, would end the generation by itself (an end-of-sequence token or the
    /// last the token budget allows); a stop string in its text is not foreseen.
    pub fn would_end(&self, id: u32) -> bool {
        self.eos_token_ids.contains(&id) || self.max_tokens.is_some_and(|max| self.generated_tokens + 1 >= max)
    }

    /// Scans newly generated text. Returns the text that can be shown: everything before the earliest stop string
    /// (which, with all that follows it, is dropped), or else everything except a suffix that may begin one.
    pub fn scan_text(&mut self, text: &str) -> StopScan {
        if self.stopped_by_string {
            return StopScan {
                text: String::new(),
                stopped: true,
            };
        }
        self.held_text.push_str(text);
        let earliest_stop = self
            .stop_strings
            .iter()
            .filter_map(|stop| self.held_text.find(stop.as_str()))
            .min();
        if let Some(position) = earliest_stop {
            self.held_text.truncate(position);
            self.stopped_by_string = true;
            return StopScan {
                text: std::mem::take(&mut self.held_text),
                stopped: true,
            };
        }
        let keep = partial_suffix_len(&self.held_text, &self.stop_strings);
        let held = self.held_text.split_off(self.held_text.len() - keep);
        StopScan {
            text: std::mem::replace(&mut self.held_text, held),
            stopped: false,
        }
    }

    /// At the end of generation: the held text, which turned out not to start a stop string.
    pub fn flush_text(&mut self) -> String {
        std::mem::take(&mut self.held_text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan_all(checker: &mut StopChecker, chunks: &[&str]) -> (String, bool) {
        let mut shown = String::new();
        for chunk in chunks {
            let scan = checker.scan_text(chunk);
            shown.push_str(&scan.text);
            if scan.stopped {
                return (shown, true);
            }
        }
        shown.push_str(&checker.flush_text());
        (shown, false)
    }

    #[test]
    fn eos_and_max_tokens() {
        let mut checker = StopChecker::new(vec![248046, 248044], vec![], Some(3));
        assert_eq!(checker.check_token(10), TokenCheck::Continue);
        assert_eq!(checker.check_token(248044), TokenCheck::EndOfSequence);
        assert_eq!(checker.check_token(11), TokenCheck::MaxTokensReached);
        assert_eq!(checker.generated_tokens(), 3);
        let mut unlimited = StopChecker::new(vec![248046], vec![], None);
        assert!((0..10_000).all(|id| unlimited.check_token(id) == TokenCheck::Continue));
        assert_eq!(unlimited.check_token(248046), TokenCheck::EndOfSequence);
    }

    #[test]
    fn would_end_foresees_what_check_token_says() {
        let mut checker = StopChecker::new(vec![248046], vec!["x".into()], Some(3));
        for id in [10, 11] {
            assert!(!checker.would_end(id) && !checker.would_end(12));
            assert!(checker.would_end(248046));
            assert_eq!(checker.check_token(id), TokenCheck::Continue);
        }
        assert!(checker.would_end(12), "the third token is the budget's last");
        assert_eq!(checker.check_token(12), TokenCheck::MaxTokensReached);
    }

    #[test]
    fn stop_string_spanning_chunks_is_cut_with_what_follows() {
        let mut checker = StopChecker::new(vec![], vec!["STOP".into()], None);
        assert_eq!(
            checker.scan_text("Hello S"),
            StopScan {
                text: "Hello ".into(),
                stopped: false
            }
        );
        assert_eq!(
            checker.scan_text("TO"),
            StopScan {
                text: "".into(),
                stopped: false
            }
        );
        assert_eq!(
            checker.scan_text("P and more"),
            StopScan {
                text: "".into(),
                stopped: true
            }
        );
        assert_eq!(
            checker.scan_text("later"),
            StopScan {
                text: "".into(),
                stopped: true
            }
        );
    }

    #[test]
    fn false_starts_are_released() {
        let mut checker = StopChecker::new(vec![], vec!["STOP".into()], None);
        assert_eq!(
            scan_all(&mut checker, &["a ST", "OX b S"]),
            ("a STOX b S".into(), false)
        );
    }

    #[test]
    fn earliest_of_several_stop_strings_wins() {
        let mut checker = StopChecker::new(vec![], vec!["world".into(), "lo w".into(), "".into()], None);
        assert_eq!(scan_all(&mut checker, &["hel", "lo world"]), ("hel".into(), true));
    }

    #[test]
    fn multibyte_stop_strings() {
        let mut checker = StopChecker::new(vec![], vec!["。\n".into()], None);
        assert_eq!(scan_all(&mut checker, &["你好", "。", "\n再见"]), ("你好".into(), true));
    }
}
