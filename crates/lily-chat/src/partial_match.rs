//! Hold-back for streamed text: the end of a chunk may be the start of a tag or stop string that the next chunk
//! completes, so that part must wait.

/// Length in bytes of the longest suffix of `text` that is a proper prefix of one of `patterns`.
/// The cut `text.len() - result` is always a char boundary: a pattern's prefix starts with a char's first byte.
pub(crate) fn partial_suffix_len<S: AsRef<str>>(text: &str, patterns: &[S]) -> usize {
    let text = text.as_bytes();
    patterns
        .iter()
        .filter_map(|pattern| {
            let pattern = pattern.as_ref().as_bytes();
            (1..pattern.len().min(text.len() + 1))
                .rev()
                .find(|&len| text.ends_with(&pattern[..len]))
        })
        .max()
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::partial_suffix_len;

    #[test]
    fn finds_longest_partial_prefix() {
        assert_eq!(partial_suffix_len("abc</th", &["</think>"]), 4);
        assert_eq!(partial_suffix_len("abc<", &["</think>", "<tool_call>"]), 1);
        assert_eq!(
            partial_suffix_len("abc</think>", &["</think>"]),
            0,
            "a whole match is not partial"
        );
        assert_eq!(partial_suffix_len("abc", &["</think>"]), 0);
        assert_eq!(partial_suffix_len("", &["</think>"]), 0);
        assert_eq!(partial_suffix_len("xx😀", &["😀!"]), "😀".len());
        assert_eq!(partial_suffix_len("a\n\n", &["\n\nEND", "\nX"]), 2);
        assert_eq!(partial_suffix_len("any", &[""]), 0);
    }
}
