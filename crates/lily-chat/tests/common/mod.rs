//! Shared by the integration tests: the real Qwen3.6 tokenizer and template from ../shared, loaded once per test
//! binary.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use lily_chat::Tokenizer;

pub fn shared_model_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/qwen3.6")
}

pub fn tokenizer() -> Arc<Tokenizer> {
    static TOKENIZER: OnceLock<Arc<Tokenizer>> = OnceLock::new();
    TOKENIZER
        .get_or_init(|| {
            Arc::new(Tokenizer::from_dir(&shared_model_dir()).expect("load ../shared/qwen3.6/tokenizer.json"))
        })
        .clone()
}
