//! Incremental detokenization with the prefix/offset method: decode a small window of recent ids twice, with and
//! without the newest ones, and emit what the newest ones added. A character whose bytes span several tokens
//! decodes to U+FFFD until its last byte arrives, so text ending in U+FFFD is held back.

use std::sync::Arc;

use crate::tokenizer::{Tokenizer, TokenizerError};

pub struct StreamDecoder {
    tokenizer: Arc<Tokenizer>,
    skip_special: bool,
    /// Ids from the start of the decode window on; earlier ids are dropped once emitted.
    window: Vec<u32>,
    /// `window[..emitted]` has been emitted as text.
    emitted: usize,
}

impl StreamDecoder {
    pub fn new(tokenizer: Arc<Tokenizer>, skip_special: bool) -> Self {
        Self {
            tokenizer,
            skip_special,
            window: Vec::new(),
            emitted: 0,
        }
    }

    /// Adds one id; returns the text it completes (empty while a character is still incomplete).
    pub fn push(&mut self, id: u32) -> Result<String, TokenizerError> {
        self.window.push(id);
        let emitted_text = self.tokenizer.decode(&self.window[..self.emitted], self.skip_special)?;
        let full_text = self.tokenizer.decode(&self.window, self.skip_special)?;
        if full_text.len() <= emitted_text.len() || full_text.ends_with(char::REPLACEMENT_CHARACTER) {
            return Ok(String::new());
        }
        let Some(new_text) = full_text.strip_prefix(emitted_text.as_str()) else {
            return Ok(String::new());
        };
        let new_text = new_text.to_string();
        // The ids just emitted become the context of the next window.
        self.window.drain(..self.emitted);
        self.emitted = self.window.len();
        Ok(new_text)
    }

    /// The text still held back (an incomplete character comes out as U+FFFD); the decoder is empty afterwards.
    pub fn flush(&mut self) -> Result<String, TokenizerError> {
        let emitted_text = self.tokenizer.decode(&self.window[..self.emitted], self.skip_special)?;
        let full_text = self.tokenizer.decode(&self.window, self.skip_special)?;
        self.window.clear();
        self.emitted = 0;
        Ok(full_text
            .strip_prefix(emitted_text.as_str())
            .unwrap_or_default()
            .to_string())
    }
}
