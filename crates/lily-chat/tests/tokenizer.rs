//! The Qwen3.6 tokenizer and the streaming detokenizer against the real tokenizer.json.

mod common;

use lily_chat::{StreamDecoder, Tokenizer, TokenizerError};
use proptest::prelude::*;
use unicode_normalization_alignments::UnicodeNormalization;

fn nfc(text: &str) -> String {
    text.nfc().map(|(ch, _)| ch).collect()
}

fn round_trip(text: &str) -> String {
    let tokenizer = common::tokenizer();
    let ids = tokenizer.encode(text, false).unwrap();
    tokenizer.decode(&ids, false).unwrap()
}

/// Decodes ids one at a time through the stream decoder, checking each piece is whole text (the text itself may
/// hold U+FFFD, then that check is off).
fn stream(ids: &[u32], text_has_replacement: bool) -> String {
    let mut decoder = StreamDecoder::new(common::tokenizer(), false);
    let mut text = String::new();
    for &id in ids {
        let piece = decoder.push(id).unwrap();
        let broken = piece.contains(char::REPLACEMENT_CHARACTER) && !text_has_replacement;
        assert!(!broken, "piece {piece:?} holds a broken character");
        text.push_str(&piece);
    }
    text.push_str(&decoder.flush().unwrap());
    text
}

#[test]
fn pinned_encoding() {
    let ids = common::tokenizer()
        .encode("The quick brown fox jumps over the lazy dog.", true)
        .unwrap();
    assert_eq!(ids, [760, 3841, 13477, 37550, 33075, 888, 279, 15217, 5388, 13]);
}

#[test]
fn special_tokens() {
    let tokenizer = common::tokenizer();
    let special = tokenizer.special();
    assert_eq!(
        [
            special.endoftext,
            special.im_start,
            special.im_end,
            special.tool_call_start,
            special.tool_call_end
        ],
        [248044, 248045, 248046, 248058, 248059]
    );
    assert_eq!(
        [
            special.tool_response_start,
            special.tool_response_end,
            special.think_start,
            special.think_end
        ],
        [248066, 248067, 248068, 248069]
    );
    assert_eq!(special.eos_ids(), [248046, 248044]);
    assert_eq!(tokenizer.token_to_id("<think>"), Some(248068));
    assert_eq!(tokenizer.id_to_token(248069).as_deref(), Some("</think>"));
    assert_eq!(tokenizer.vocab_size(), 248_044 + 33);
    assert!(tokenizer.is_special(248046) && tokenizer.is_special(248068));
    assert!(!tokenizer.is_special(760));
}

#[test]
fn special_token_text_encodes_to_single_tokens() {
    let tokenizer = common::tokenizer();
    let ids = tokenizer
        .encode("<|im_start|>user\nHi<|im_end|>\n<think>\n</think><tool_call>", false)
        .unwrap();
    assert_eq!(ids[0], 248045);
    assert!(ids.contains(&248046) && ids.contains(&248068) && ids.contains(&248069));
    assert_eq!(*ids.last().unwrap(), 248058);
    assert_eq!(tokenizer.decode(&ids, true).unwrap(), "user\nHi\n\n");
}

#[test]
fn nfc_normalisation() {
    let tokenizer = common::tokenizer();
    let composed = tokenizer.encode("caf\u{e9}", false).unwrap();
    let decomposed = tokenizer.encode("cafe\u{301}", false).unwrap();
    assert_eq!(composed, decomposed);
    assert_eq!(round_trip("cafe\u{301}"), "caf\u{e9}");
}

#[test]
fn emoji_and_cjk_round_trip() {
    for text in [
        "日本語のテキスト、中文，한국어",
        "👩‍👩‍👧 family 🇫🇷 flag 🤖",
        "mixed: naïve 漢字 😀\n\ttabs  spaces",
    ] {
        assert_eq!(round_trip(text), text);
        let ids = common::tokenizer().encode(text, false).unwrap();
        assert_eq!(stream(&ids, false), text);
    }
}

#[test]
fn stream_decoder_holds_incomplete_characters() {
    let tokenizer = common::tokenizer();
    // A rare CJK character is split into byte tokens: no piece may show half of it.
    let text = "𠜎𠜱";
    let ids = tokenizer.encode(text, false).unwrap();
    assert!(ids.len() > 2, "expected multi-token characters, got {ids:?}");
    let mut decoder = StreamDecoder::new(tokenizer.clone(), false);
    let pieces: Vec<String> = ids.iter().map(|&id| decoder.push(id).unwrap()).collect();
    assert!(
        pieces.iter().any(String::is_empty),
        "some tokens must be held: {pieces:?}"
    );
    assert_eq!(pieces.concat(), text);
    assert_eq!(decoder.flush().unwrap(), "");
}

#[test]
fn stream_decoder_flushes_a_cut_character_as_replacement() {
    let tokenizer = common::tokenizer();
    let ids = tokenizer.encode("𠜎", false).unwrap();
    let mut decoder = StreamDecoder::new(tokenizer, false);
    assert_eq!(decoder.push(ids[0]).unwrap(), "");
    assert!(decoder.flush().unwrap().contains(char::REPLACEMENT_CHARACTER));
}

#[test]
fn stream_decoder_skips_special_tokens_when_asked() {
    let tokenizer = common::tokenizer();
    let ids = tokenizer.encode("<|im_start|>assistant\nHi<|im_end|>", false).unwrap();
    let mut decoder = StreamDecoder::new(tokenizer, true);
    let text: String = ids.iter().map(|&id| decoder.push(id).unwrap()).collect();
    assert_eq!(text + &decoder.flush().unwrap(), "assistant\nHi");
}

#[test]
fn loading_errors_are_clear() {
    let dir = tempfile::tempdir().unwrap();
    let error = Tokenizer::from_dir(dir.path()).unwrap_err();
    assert!(matches!(error, TokenizerError::NotFound(_)), "{error}");
    let path = dir.path().join("tokenizer.json");
    std::fs::write(&path, "{not json").unwrap();
    let error = Tokenizer::from_dir(dir.path()).unwrap_err();
    assert!(error.to_string().contains("tokenizer.json"), "{error}");
}

#[test]
fn loads_the_compressed_tokenizer_of_the_bundled_model() {
    let model_dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/lily-tiny-shakespeare");
    let tokenizer = Tokenizer::from_dir(&model_dir).unwrap();
    assert_eq!(
        tokenizer
            .encode("The quick brown fox jumps over the lazy dog.", false)
            .unwrap()[..3],
        [760, 3841, 13477]
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn arbitrary_strings_round_trip(text in any::<String>()) {
        prop_assert_eq!(round_trip(&text), nfc(&text));
    }

    #[test]
    fn arbitrary_strings_stream_back_whole(text in "\\PC{0,40}") {
        let ids = common::tokenizer().encode(&text, false).unwrap();
        prop_assert_eq!(stream(&ids, text.contains(char::REPLACEMENT_CHARACTER)), nfc(&text));
    }
}
