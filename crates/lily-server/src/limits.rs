//! How much work one request may ask for, checked before it is queued: the number of choices (prompts x `n`) and
//! the tokens they may occupy together (each choice's prompt plus its `max_tokens`). Together with `--max-queue`
//! they bound the work, and the memory, that waiting requests can hold.

use crate::engine::SequenceSpec;
use crate::error::ApiError;

/// The default of `--max-choices`.
pub const DEFAULT_MAX_CHOICES: usize = 128;
/// `--max-request-tokens` defaults to this many contexts' worth of tokens.
pub const DEFAULT_REQUEST_CONTEXTS: usize = 16;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestLimits {
    /// Most choices (prompts x `n`) one request may ask for.
    pub max_choices: usize,
    /// Most tokens (prompt plus `max_tokens`, summed over the choices) one request may ask for.
    pub max_request_tokens: usize,
}

impl RequestLimits {
    /// Refuses a request for more than `max_choices` choices; `param` names the field the client should change.
    pub fn check_choices(&self, prompts: usize, n: usize, param: &str) -> Result<(), ApiError> {
        let choices = prompts.saturating_mul(n);
        if choices > self.max_choices {
            return Err(ApiError::invalid(
                param,
                format!(
                    "The request asks for {choices} choices ({prompts} prompt(s) x n = {n}), more than this server's \
                     limit of {} per request.",
                    self.max_choices
                ),
            )
            .with_code("too_many_choices"));
        }
        Ok(())
    }

    /// Refuses a request whose choices may occupy more than `max_request_tokens` tokens together.
    pub fn check_work(&self, sequences: &[SequenceSpec]) -> Result<(), ApiError> {
        let work = sequences.iter().fold(0usize, |sum, s| sum.saturating_add(s.work()));
        if work > self.max_request_tokens {
            return Err(ApiError::invalid(
                "max_tokens",
                format!(
                    "The request may need {work} tokens (prompt plus `max_tokens`, summed over its {} choice(s)), \
                     more than this server's limit of {} per request; lower `max_tokens` or `n`.",
                    sequences.len(),
                    self.max_request_tokens
                ),
            )
            .with_code("request_too_large"));
        }
        Ok(())
    }
}

/// Most tokens a prompt may have: one fewer than the context, which must also hold a generated token.
pub fn prompt_limit(context: usize) -> usize {
    context.saturating_sub(1)
}

/// The 400 for a prompt found, partway through tokenizing it, to be longer than the context allows.
pub fn prompt_too_long(param: &str, context: usize) -> ApiError {
    ApiError::invalid(
        param,
        format!(
            "The prompt is more than {} tokens long, but the context holds {context} tokens (prompt and completion \
             together); shorten the prompt.",
            prompt_limit(context)
        ),
    )
    .with_code("context_length_exceeded")
}
