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

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    special: SpecialTokens,
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
        Ok(Self { inner, special })
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
        self.inner.get_vocab_size(true)
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
