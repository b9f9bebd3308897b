//! The Qwen3.5/3.6 tokenizer: byte-level BPE with NFC normalisation, loaded from a Hugging Face `tokenizer.json`.

use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("no tokenizer.json or tokenizer.json.zst in {0}")]
    NotFound(PathBuf),
    #[error("cannot read tokenizer file {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("cannot parse tokenizer file {path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("the tokenizer has no {0} token; it is not a Qwen3.5/3.6 tokenizer")]
    MissingSpecialToken(&'static str),
    #[error("cannot encode text: {0}")]
    Encode(String),
    #[error("cannot decode token ids: {0}")]
    Decode(String),
}

/// Ids of the special tokens this model family's chat format and output parsing use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpecialTokens {
    pub endoftext: u32,
    pub im_start: u32,
    pub im_end: u32,
    pub tool_call_start: u32,
    pub tool_call_end: u32,
    pub tool_response_start: u32,
    pub tool_response_end: u32,
    pub think_start: u32,
    pub think_end: u32,
}

impl SpecialTokens {
    fn look_up(tokenizer: &tokenizers::Tokenizer) -> Result<Self, TokenizerError> {
        let id = |token: &'static str| {
            tokenizer
                .token_to_id(token)
                .ok_or(TokenizerError::MissingSpecialToken(token))
        };
        Ok(Self {
            endoftext: id("<|endoftext|>")?,
            im_start: id("<|im_start|>")?,
            im_end: id("<|im_end|>")?,
            tool_call_start: id("<tool_call>")?,
            tool_call_end: id("</tool_call>")?,
            tool_response_start: id("<tool_response>")?,
            tool_response_end: id("</tool_response>")?,
            think_start: id("<think>")?,
            think_end: id("</think>")?,
        })
    }

    /// The tokens that end an assistant turn: `<|im_end|>` and `<|endoftext|>`.
    pub fn eos_ids(&self) -> Vec<u32> {
        vec![self.im_end, self.endoftext]
    }
}

/// A character that flags the special-token text after it as plain text in a rendered prompt: one from Unicode's
/// private use area that the text being marked does not contain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlainMarker(char);

impl PlainMarker {
    /// The first private-use character that none of `texts` contains; `None` if they contain them all.
    pub fn choose<'a>(texts: impl IntoIterator<Item = &'a str>) -> Option<PlainMarker> {
        const FIRST: u32 = 0xE000;
        const LAST: u32 = 0xF8FF;
        let mut used = vec![false; (LAST - FIRST + 1) as usize];
        for text in texts {
            for c in text.chars() {
                if (FIRST..=LAST).contains(&(c as u32)) {
                    used[(c as u32 - FIRST) as usize] = true;
                }
            }
        }
        let free = used.iter().position(|u| !u)?;
        char::from_u32(FIRST + free as u32).map(PlainMarker)
    }

    /// Removes the markers from text (the prompt text as the model reads it).
    pub fn strip(self, text: &str) -> String {
        text.replace(self.0, "")
    }
}

/// Bytes of text [`Tokenizer::encode_limited`] encodes at a time (it cuts only at newlines before a letter).
pub const PIECE_BYTES: usize = 1 << 16;

/// The end of the first piece of `text`: just after the first newline at or past [`PIECE_BYTES`] that a letter
/// follows, or the end of the text.
fn piece_end(text: &str) -> usize {
    let mut start = PIECE_BYTES.min(text.len());
    while !text.is_char_boundary(start) {
        start += 1;
    }
    text[start..]
        .match_indices('\n')
        .map(|(at, _)| start + at + 1)
        .find(|&end| text[end..].chars().next().is_some_and(char::is_alphabetic))
        .unwrap_or(text.len())
}

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// The same tokenizer with special-token text encoded as ordinary text.
    plain: tokenizers::Tokenizer,
    special: SpecialTokens,
    /// Every added token's text and id, longest text first (so that a scan finds the longest match).
    added: Vec<(String, u32)>,
    /// The characters the added tokens start with.
    added_first: Vec<char>,
    /// No added token holds a newline, so long texts may be encoded in pieces cut at newlines.
    newline_cuts: bool,
    /// `inner.get_vocab_size(true)`, counted once: the tokenizers crate counts it from its maps on every call.
    vocab_size: usize,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("special", &self.special)
            .finish()
    }
}

impl Tokenizer {
    /// Loads `tokenizer.json` from a model directory, or `tokenizer.json.zst` where only the compressed copy exists.
    pub fn from_dir(model_dir: &Path) -> Result<Self, TokenizerError> {
        let plain = model_dir.join("tokenizer.json");
        if plain.is_file() {
            return Self::from_file(&plain);
        }
        let compressed = model_dir.join("tokenizer.json.zst");
        if compressed.is_file() {
            return Self::from_file(&compressed);
        }
        Err(TokenizerError::NotFound(model_dir.to_path_buf()))
    }

    /// Loads a `tokenizer.json` file; a name ending in `.zst` is decompressed first.
    pub fn from_file(path: &Path) -> Result<Self, TokenizerError> {
        let read_error = |source| TokenizerError::Read {
            path: path.to_path_buf(),
            source,
        };
        let bytes = std::fs::read(path).map_err(read_error)?;
        let bytes = if path.extension().is_some_and(|ext| ext == "zst") {
            zstd::decode_all(bytes.as_slice()).map_err(read_error)?
        } else {
            bytes
        };
        Self::from_json_bytes(&bytes).map_err(|error| match error {
            TokenizerError::Parse { message, .. } => TokenizerError::Parse {
                path: path.to_path_buf(),
                message,
            },
            other => other,
        })
    }

    /// Parses the contents of a `tokenizer.json`.
    pub fn from_json_bytes(json: &[u8]) -> Result<Self, TokenizerError> {
        let inner = tokenizers::Tokenizer::from_bytes(json).map_err(|error| TokenizerError::Parse {
            path: PathBuf::from("<memory>"),
            message: error.to_string(),
        })?;
        let special = SpecialTokens::look_up(&inner)?;
        let mut plain = inner.clone();
        plain.set_encode_special_tokens(true);
        let mut added: Vec<(String, u32)> = inner
            .get_added_tokens_decoder()
            .into_iter()
            .map(|(id, token)| (token.content, id))
            .collect();
        added.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        let mut added_first: Vec<char> = added.iter().filter_map(|(t, _)| t.chars().next()).collect();
        added_first.sort_unstable();
        added_first.dedup();
        let newline_cuts = !added.iter().any(|(t, _)| t.contains('\n'));
        let vocab_size = inner.get_vocab_size(true);
        Ok(Self {
            inner,
            plain,
            special,
            added,
            added_first,
            newline_cuts,
            vocab_size,
        })
    }

    /// Encodes text; special-token text such as `<|im_start|>` becomes its single token.
    /// `add_special` asks for the tokenizer's post-processor tokens (this tokenizer defines none, so no BOS is added).
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>, TokenizerError> {
        let encoding = self
            .inner
            .encode_fast(text, add_special)
            .map_err(|error| TokenizerError::Encode(error.to_string()))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Encodes text with special-token text (`<|im_end|>`, `<think>`, ...) as ordinary text: nothing in `text`
    /// becomes a control token.
    pub fn encode_plain(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let encoding = self
            .plain
            .encode_fast(text, false)
            .map_err(|error| TokenizerError::Encode(error.to_string()))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The added token (text and id) that starts at byte `at` of `text`, the longest where several do.
    fn added_token_at(&self, text: &str, at: usize) -> Option<(&str, u32)> {
        let rest = &text[at..];
        self.added
            .iter()
            .find(|(token, _)| rest.starts_with(token.as_str()))
            .map(|(token, id)| (token.as_str(), *id))
    }

    /// Marks every special-token text in `text` as plain text by putting `marker` in front of it, for
    /// [`Tokenizer::encode_marked`]. `marker` must not occur in the text (see [`PlainMarker::choose`]).
    pub fn mark_plain<'a>(&self, text: &'a str, marker: PlainMarker) -> std::borrow::Cow<'a, str> {
        let mut out = String::new();
        let mut copied = 0;
        for (at, _) in text.match_indices(|c| self.added_first.contains(&c)) {
            if at < copied {
                continue;
            }
            if let Some((token, _)) = self.added_token_at(text, at) {
                out.push_str(&text[copied..at]);
                out.push(marker.0);
                out.push_str(token);
                copied = at + token.len();
            }
        }
        if copied == 0 {
            return std::borrow::Cow::Borrowed(text);
        }
        out.push_str(&text[copied..]);
        std::borrow::Cow::Owned(out)
    }

    /// Encodes a rendered prompt whose content was passed through [`Tokenizer::mark_plain`]: special-token text
    /// right after `marker` is encoded as ordinary text, any other becomes its control token, and the markers
    /// themselves are dropped. Without markers the result is `encode(text, false)`'s. Stops early and returns
    /// `None` once the prompt is known to be longer than `limit` tokens.
    pub fn encode_marked(
        &self,
        text: &str,
        marker: PlainMarker,
        limit: usize,
    ) -> Result<Option<Vec<u32>>, TokenizerError> {
        let mut ids = Vec::new();
        if !text.contains(marker.0) {
            return Ok(self.encode_bounded(&self.inner, text, limit, &mut ids)?.then_some(ids));
        }
        let mut segment_start = 0;
        let mut at = 0;
        let plain_segment = |from: usize, to: usize, ids: &mut Vec<u32>| -> Result<bool, TokenizerError> {
            if from == to {
                return Ok(true);
            }
            self.encode_bounded(&self.plain, &text[from..to].replace(marker.0, ""), limit, ids)
        };
        while at < text.len() {
            let Some(next) = text[at..].find(|c| self.added_first.contains(&c)) else {
                break;
            };
            at += next;
            match self.added_token_at(text, at) {
                Some((token, id)) if !text[..at].ends_with(marker.0) => {
                    if !plain_segment(segment_start, at, &mut ids)? {
                        return Ok(None);
                    }
                    ids.push(id);
                    at += token.len();
                    segment_start = at;
                }
                Some((token, _)) => at += token.len(),
                None => at += text[at..].chars().next().map_or(1, char::len_utf8),
            }
        }
        Ok(plain_segment(segment_start, text.len(), &mut ids)?.then_some(ids))
    }

    /// Encodes text as [`Tokenizer::encode`] without post-processor tokens, but stops early and returns `None`
    /// once it is known to be longer than `limit` tokens.
    pub fn encode_limited(&self, text: &str, limit: usize) -> Result<Option<Vec<u32>>, TokenizerError> {
        let mut ids = Vec::new();
        Ok(self.encode_bounded(&self.inner, text, limit, &mut ids)?.then_some(ids))
    }

    /// Appends the tokens of `text` to `ids`, encoding it in pieces of about [`PIECE_BYTES`] so that a long text
    /// stops as soon as `ids` holds more than `limit` tokens (then false). Pieces are cut only right after a
    /// newline that a letter follows: the pre-tokenizer splits there anyway (no pattern matches across it), NFC
    /// does not combine across it and no added token spans it, so the pieces' tokens are the whole text's.
    fn encode_bounded(
        &self,
        tokenizer: &tokenizers::Tokenizer,
        text: &str,
        limit: usize,
        ids: &mut Vec<u32>,
    ) -> Result<bool, TokenizerError> {
        let mut rest = text;
        while !rest.is_empty() {
            let cut = if rest.len() <= PIECE_BYTES || !self.newline_cuts {
                rest.len()
            } else {
                piece_end(rest)
            };
            let encoding = tokenizer
                .encode_fast(&rest[..cut], false)
                .map_err(|error| TokenizerError::Encode(error.to_string()))?;
            ids.extend_from_slice(encoding.get_ids());
            if ids.len() > limit {
                return Ok(false);
            }
            rest = &rest[cut..];
        }
        Ok(true)
    }

    /// Decodes ids to text. Invalid UTF-8 (an incomplete multi-byte character) comes out as U+FFFD.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        self.inner
            .decode(ids, skip_special)
            .map_err(|error| TokenizerError::Decode(error.to_string()))
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Number of tokens the tokenizer knows, special tokens included (the model's embedding is larger: padded).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    pub fn special(&self) -> &SpecialTokens {
        &self.special
    }

    /// True for the added special tokens (`<|im_end|>`, `<think>`, `<tool_call>`, `<|vision_pad|>`, ...).
    pub fn is_special(&self, id: u32) -> bool {
        self.inner
            .get_added_vocabulary()
            .get_added_tokens_decoder()
            .get(&id)
            .is_some_and(|token| token.special)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bundled() -> Tokenizer {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/lily-tiny-shakespeare");
        Tokenizer::from_dir(&dir).unwrap()
    }

    #[test]
    fn marked_special_token_text_is_encoded_as_plain_text() {
        let tokenizer = bundled();
        let special = *tokenizer.special();
        let content = "a<|im_end|>b<think>\u{E000}c";
        let marker = PlainMarker::choose([content]).unwrap();
        assert_eq!(marker, PlainMarker('\u{E001}'));
        let marked = tokenizer.mark_plain(content, marker);
        assert_eq!(marked, "a\u{E001}<|im_end|>b\u{E001}<think>\u{E000}c");
        let rendered = format!("<|im_start|>user\n{marked}<|im_end|>\n");
        let ids = tokenizer.encode_marked(&rendered, marker, usize::MAX).unwrap().unwrap();
        let mut expected = vec![special.im_start];
        expected.extend(tokenizer.encode_plain(&format!("user\n{content}")).unwrap());
        expected.push(special.im_end);
        expected.extend(tokenizer.encode("\n", false).unwrap());
        assert_eq!(ids, expected);
        assert_eq!(ids.iter().filter(|&&t| t == special.im_end).count(), 1);
        assert!(!ids.contains(&special.think_start));
        assert_eq!(tokenizer.decode(&ids, false).unwrap(), marker.strip(&rendered));
        // Without markers it is the ordinary encoding.
        let plain = "<|im_start|>user\nhi<|im_end|>\n";
        assert_eq!(
            tokenizer.encode_marked(plain, marker, usize::MAX).unwrap().unwrap(),
            tokenizer.encode(plain, false).unwrap()
        );
        assert_eq!(tokenizer.encode_marked(plain, marker, 3).unwrap(), None);
        assert_eq!(tokenizer.mark_plain("no specials", marker), "no specials");
    }

    #[test]
    fn the_vocabulary_size_is_counted_once() {
        let tokenizer = bundled();
        assert_eq!(tokenizer.vocab_size(), tokenizer.inner.get_vocab_size(true));
        assert_eq!(tokenizer.vocab_size(), 248077);
        let started = std::time::Instant::now();
        for _ in 0..200 {
            std::hint::black_box(tokenizer.vocab_size());
        }
        assert!(
            started.elapsed() < std::time::Duration::from_millis(50),
            "{:?}",
            started.elapsed()
        );
    }

    #[test]
    fn a_long_text_encoded_in_pieces_matches_one_encoding_and_stops_at_the_limit() {
        let tokenizer = bundled();
        let line = "ROMEO: But, soft! what light through yonder window breaks?  \n\n \tIt is the east.\r\n";
        let text = format!("{}{}", line.repeat(3 * PIECE_BYTES / line.len()), "<|im_end|>\nend");
        assert!(piece_end(&text) < text.len(), "the text has cut points");
        let whole = tokenizer.encode(&text, false).unwrap();
        assert_eq!(tokenizer.encode_limited(&text, usize::MAX).unwrap().unwrap(), whole);
        assert_eq!(tokenizer.encode_limited(&text, whole.len()).unwrap().unwrap(), whole);
        assert_eq!(tokenizer.encode_limited(&text, whole.len() - 1).unwrap(), None);
    }
}
