//! The bytes of a single token, for logprobs' `bytes` and `token` fields and for constrained decoding's token trie.
//! The tokenizer is byte-level BPE: a vocabulary entry spells its bytes with GPT-2's byte-to-character table, so a
//! token that is part of a multi-byte character still has exact bytes (its text alone is not valid UTF-8).

use std::sync::OnceLock;

use crate::Tokenizer;

/// GPT-2's table, inverted: character -> byte.
fn char_to_byte() -> &'static std::collections::HashMap<char, u8> {
    static TABLE: OnceLock<std::collections::HashMap<char, u8>> = OnceLock::new();
    TABLE.get_or_init(|| {
        let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        let mut table = std::collections::HashMap::new();
        let mut next = 0u32;
        for b in 0u32..=255 {
            let c = if printable(b) {
                b
            } else {
                next += 1;
                255 + next
            };
            table.insert(char::from_u32(c).expect("valid char"), b as u8);
        }
        table
    })
}

/// The token's bytes: the special tokens' text, else the byte-level spelling decoded.
pub fn token_bytes(tokenizer: &Tokenizer, id: u32) -> Vec<u8> {
    let Some(piece) = tokenizer.id_to_token(id) else {
        return Vec::new();
    };
    if tokenizer.is_special(id) {
        return piece.into_bytes();
    }
    let table = char_to_byte();
    let bytes: Option<Vec<u8>> = piece.chars().map(|c| table.get(&c).copied()).collect();
    match bytes {
        Some(bytes) => bytes,
        // Not a byte-level spelling (an added token): its text is what it decodes to.
        None => tokenizer.decode(&[id], false).unwrap_or(piece).into_bytes(),
    }
}

/// The token as text (bytes that are not valid UTF-8 on their own are shown as U+FFFD) and its bytes.
pub fn token_text(tokenizer: &Tokenizer, id: u32) -> (String, Vec<u8>) {
    let bytes = token_bytes(tokenizer, id);
    (String::from_utf8_lossy(&bytes).into_owned(), bytes)
}
