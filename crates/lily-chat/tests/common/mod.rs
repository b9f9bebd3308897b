//! Shared by the integration tests: the real Qwen3.6 tokenizer, as bundled with the default model under models/
//! (the same file as the released model's), loaded once per test binary.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use lily_chat::Tokenizer;

pub fn model_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/lily-tiny-shakespeare")
}

pub fn tokenizer() -> Arc<Tokenizer> {
    static TOKENIZER: OnceLock<Arc<Tokenizer>> = OnceLock::new();
    TOKENIZER
        .get_or_init(|| Arc::new(Tokenizer::from_dir(&model_dir()).expect("load the bundled tokenizer")))
        .clone()
}
