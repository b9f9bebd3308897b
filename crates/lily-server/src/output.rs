//! Generated tokens to client-visible deltas: lily-chat's `OutputStream` for chat (reasoning split, tool calls,
//! stop strings), and for `/v1/completions` the same detokenizer and stop checker without the chat parsing (raw
//! text, special tokens skipped, as OpenAI's and vLLM's completions return it).

use std::sync::Arc;

use lily_chat::{
    Delta, FinalOutput, FinishReason, OutputOptions, OutputStream, StopChecker, StreamDecoder, TokenCheck,
};
use lily_chat::{Tokenizer, TokenizerError};

#[allow(clippy::large_enum_variant)] // one per generated sequence
pub enum Output {
    Chat(OutputStream),
    Text(TextStream),
}

impl Output {
    pub fn push_token(&mut self, id: u32) -> Result<Vec<Delta>, TokenizerError> {
        match self {
            Output::Chat(s) => s.push_token(id),
            Output::Text(s) => s.push_token(id),
        }
    }

    pub fn is_finished(&self) -> bool {
        match self {
            Output::Chat(s) => s.is_finished(),
            Output::Text(s) => s.is_finished(),
        }
    }

    pub fn finish(self) -> Result<FinalOutput, TokenizerError> {
        match self {
            Output::Chat(s) => s.finish(),
            Output::Text(s) => s.finish(),
        }
    }
}

/// Plain text output for completions.
pub struct TextStream {
    decoder: StreamDecoder,
    stop: StopChecker,
    stop_reason: Option<FinishReason>,
    stopped_by_string: bool,
    text: String,
}

impl TextStream {
    pub fn new(tokenizer: Arc<Tokenizer>, options: OutputOptions) -> TextStream {
        TextStream {
            decoder: StreamDecoder::new(tokenizer, true),
            stop: StopChecker::new(options.eos_token_ids, options.stop_strings, options.max_tokens),
            stop_reason: None,
            stopped_by_string: false,
            text: String::new(),
        }
    }

    pub fn push_token(&mut self, id: u32) -> Result<Vec<Delta>, TokenizerError> {
        if self.stop_reason.is_some() {
            return Ok(Vec::new());
        }
        match self.stop.check_token(id) {
            TokenCheck::EndOfSequence => {
                self.stop_reason = Some(FinishReason::Stop);
                return Ok(Vec::new());
            }
            TokenCheck::MaxTokensReached => self.stop_reason = Some(FinishReason::Length),
            TokenCheck::Continue => {}
        }
        let text = self.decoder.push(id)?;
        let scan = self.stop.scan_text(&text);
        if scan.stopped {
            self.stop_reason = Some(FinishReason::Stop);
            self.stopped_by_string = true;
        }
        Ok(self.emit(scan.text))
    }

    pub fn is_finished(&self) -> bool {
        self.stop_reason.is_some()
    }

    pub fn finish(mut self) -> Result<FinalOutput, TokenizerError> {
        let mut deltas = Vec::new();
        if !self.stopped_by_string {
            let decoded = self.decoder.flush()?;
            let scan = self.stop.scan_text(&decoded);
            deltas.extend(self.emit(scan.text));
            if scan.stopped {
                self.stop_reason = Some(FinishReason::Stop);
            } else {
                let held = self.stop.flush_text();
                deltas.extend(self.emit(held));
            }
        }
        Ok(FinalOutput {
            deltas,
            reasoning: String::new(),
            content: self.text,
            tool_calls: Vec::new(),
            finish_reason: self.stop_reason.unwrap_or(FinishReason::Length),
            completion_tokens: self.stop.generated_tokens(),
        })
    }

    fn emit(&mut self, text: String) -> Vec<Delta> {
        if text.is_empty() {
            return Vec::new();
        }
        self.text.push_str(&text);
        vec![Delta::Content(text)]
    }
}
