//! `POST /v1/completions` (the legacy text API): raw prompts (text or token ids) in, text out.

use std::sync::Arc;

use lily_chat::{Delta, Tokenizer};
use serde_json::{Map, Value as Json};

use crate::engine::{Event, OutputKind, RequestSpec, SequenceSpec};
use crate::error::ApiError;
use crate::limits::{prompt_limit, prompt_too_long};
use crate::logits::TokenLogprob;
use crate::params;
use crate::server::Ready;
use crate::structured;
use crate::token_bytes::token_text;
use crate::types::*;

/// Top logprobs per position for completions (OpenAI allows 5; vLLM 20).
pub const MAX_LOGPROBS: i64 = 20;
/// OpenAI's default `max_tokens` for completions.
pub const DEFAULT_MAX_TOKENS: i64 = 16;

pub struct CompletionPlan {
    pub stream: bool,
    pub include_usage: bool,
    pub logprobs: bool,
    /// Per choice: its prompt's text, shown first when `echo` is set.
    pub echo: Vec<Option<Arc<str>>>,
    pub n: usize,
    pub prompt_tokens: usize,
    pub sequences: Vec<SequenceSpec>,
}

pub fn prepare(request: CompletionRequest, sampling: RawSampling, ready: &Ready) -> Result<CompletionPlan, ApiError> {
    let prompt = request
        .prompt
        .ok_or_else(|| ApiError::invalid("prompt", "`prompt` is required"))?;
    let sampling = params::validate(sampling, &ready.defaults, ready.vocab_size)?;
    let prompt_count = match &prompt {
        PromptField::Text(_) | PromptField::Tokens(_) => 1,
        PromptField::Texts(texts) => texts.len(),
        PromptField::TokenLists(lists) => lists.len(),
    };
    let choices_param = if prompt_count > 1 { "prompt" } else { "n" };
    ready.limits.check_choices(prompt_count, sampling.n, choices_param)?;
    let tokenizer = &ready.tokenizer;
    // A prompt longer than the context is refused as soon as tokenizing it has gone past the context.
    let encode = |text: &str| {
        tokenizer
            .encode_limited(text, prompt_limit(ready.context))
            .map_err(|e| ApiError::invalid("prompt", format!("cannot tokenize the prompt: {e}")))?
            .ok_or_else(|| prompt_too_long("prompt", ready.context))
    };
    let check_ids = |ids: Vec<i64>| -> Result<Vec<u32>, ApiError> {
        ids.into_iter()
            .map(|id| {
                u32::try_from(id)
                    .ok()
                    .filter(|&t| (t as usize) < ready.vocab_size)
                    .ok_or_else(|| {
                        ApiError::invalid(
                            "prompt",
                            format!("token id {id} is outside the vocabulary (0..{})", ready.vocab_size),
                        )
                    })
            })
            .collect()
    };
    // The text of a prompt given as token ids is needed only to echo it; decoding tens of thousands of ids costs
    // milliseconds that every such request would otherwise pay before its prefill.
    let echo = request.echo.unwrap_or(false);
    let text_of = |ids: &[u32]| {
        if echo {
            tokenizer.decode(ids, false).unwrap_or_default()
        } else {
            String::new()
        }
    };
    let prompts: Vec<(Vec<u32>, String)> = match prompt {
        PromptField::Text(text) => vec![(encode(&text)?, text)],
        PromptField::Texts(texts) => texts
            .into_iter()
            .map(|t| Ok((encode(&t)?, t)))
            .collect::<Result<_, ApiError>>()?,
        PromptField::Tokens(ids) => {
            let ids = check_ids(ids)?;
            let text = text_of(&ids);
            vec![(ids, text)]
        }
        PromptField::TokenLists(lists) => lists
            .into_iter()
            .map(|ids| {
                let ids = check_ids(ids)?;
                let text = text_of(&ids);
                Ok((ids, text))
            })
            .collect::<Result<_, ApiError>>()?,
    };
    if prompts.is_empty() {
        return Err(ApiError::invalid("prompt", "`prompt` must not be an empty list"));
    }
    if prompts.iter().any(|(ids, _)| ids.is_empty()) {
        return Err(ApiError::invalid("prompt", "`prompt` must not be empty"));
    }
    if request.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid(
            "suffix",
            "`suffix` (fill-in-the-middle) is not supported by this model",
        ));
    }
    let logprobs = match request.logprobs {
        None => None,
        Some(k) if (0..=MAX_LOGPROBS).contains(&k) => Some(k as usize),
        Some(k) => {
            return Err(ApiError::invalid(
                "logprobs",
                format!("`logprobs` must be between 0 and {MAX_LOGPROBS}, got {k}"),
            ))
        }
    };
    match request.best_of {
        None => {}
        Some(b) if b as usize == sampling.n => {}
        Some(b) => {
            return Err(ApiError::invalid(
                "best_of",
                format!(
                    "`best_of` other than `n` is not supported (got best_of {b}, n {})",
                    sampling.n
                ),
            ))
        }
    }
    let constraint = structured::for_completion(request.response_format.as_ref(), request.structured_outputs.as_ref())?
        .map(|(spec, param)| structured::compile(ready.structured.get(), &spec, param))
        .transpose()?;
    let stream = request.stream.unwrap_or(false);
    if request.stream_options.is_some() && !stream {
        return Err(ApiError::invalid(
            "stream_options",
            "`stream_options` is only allowed when `stream` is true",
        ));
    }
    let include_usage = request
        .stream_options
        .as_ref()
        .and_then(|o| o.include_usage)
        .unwrap_or(false);
    let requested = Some(request.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS));
    let shared = Arc::new(RequestSpec {
        kind: OutputKind::Text,
        penalties: sampling.penalties,
        stop: sampling.stop,
        ignore_eos: request.ignore_eos.unwrap_or(false),
        logprobs,
        prompt_logprobs: logprobs.filter(|_| echo),
        constraint,
    });
    let mut sequences = Vec::new();
    let mut prompt_tokens = 0;
    let mut echoes = Vec::new();
    // With `echo`, `max_tokens` 0 asks for the prompt and its logprobs alone (how evaluation harnesses score text).
    let least = if echo { 0 } else { 1 };
    for (p, (ids, text)) in prompts.into_iter().enumerate() {
        let max_tokens = if request.max_tokens.is_none() {
            // The default of 16 shrinks to fit the context rather than failing.
            let room = ready.context.saturating_sub(ids.len());
            params::max_tokens(
                Some(DEFAULT_MAX_TOKENS.min(room.max(1) as i64)),
                1,
                "max_tokens",
                "prompt",
                ids.len(),
                ready.context,
            )?
        } else {
            params::max_tokens(requested, least, "max_tokens", "prompt", ids.len(), ready.context)?
        };
        prompt_tokens += ids.len();
        let ids = Arc::new(ids);
        let prompt_text: Arc<str> = text.into();
        for j in 0..sampling.n {
            let mut sampling_params = sampling.params.clone();
            sampling_params.seed = sampling_params.seed.wrapping_add(j as u64);
            sequences.push(SequenceSpec {
                index: p * sampling.n + j,
                prompt: ids.clone(),
                prompt_text: prompt_text.clone(),
                sampling: sampling_params,
                max_tokens,
                request: shared.clone(),
            });
            echoes.push(echo.then(|| prompt_text.clone()));
        }
    }
    ready.limits.check_work(&sequences)?;
    Ok(CompletionPlan {
        stream,
        include_usage,
        logprobs: logprobs.is_some(),
        echo: echoes,
        n: sampling.n,
        prompt_tokens,
        sequences,
    })
}

pub struct CompletionResponder {
    pub id: String,
    pub created: u64,
    pub model: String,
    tokenizer: Arc<Tokenizer>,
    include_usage: bool,
    logprobs: bool,
    prompt_tokens: usize,
    completion_tokens: usize,
    /// Prompt tokens taken from the prefix cache, over the choices finished so far.
    cached_tokens: usize,
    echo: Vec<Option<Arc<str>>>,
    started: Vec<bool>,
    /// Per choice: logprobs not yet sent (streaming) or all of them (not streaming), and the text length so far
    /// (for `text_offset`).
    pending: Vec<CompletionLogprobs>,
    offsets: Vec<usize>,
    texts: Vec<String>,
    finish: Vec<Option<&'static str>>,
}

impl CompletionResponder {
    pub fn new(plan: &CompletionPlan, model: String, tokenizer: Arc<Tokenizer>) -> Self {
        let n = plan.sequences.len();
        CompletionResponder {
            id: params::random_id("cmpl-"),
            created: params::unix_now(),
            model,
            tokenizer,
            include_usage: plan.include_usage,
            logprobs: plan.logprobs,
            prompt_tokens: plan.prompt_tokens,
            completion_tokens: 0,
            cached_tokens: 0,
            echo: plan.echo.clone(),
            started: vec![false; n],
            pending: vec![CompletionLogprobs::default(); n],
            // With prompt logprobs the offsets count from the prompt's first token; otherwise from the end of the
            // echoed prompt, if any.
            offsets: plan
                .echo
                .iter()
                .zip(&plan.sequences)
                .map(|(e, seq)| match (e, seq.request.prompt_logprobs) {
                    (Some(text), None) => text.chars().count(),
                    _ => 0,
                })
                .collect(),
            texts: vec![String::new(); n],
            finish: vec![None; n],
        }
    }

    /// One token's entry: its logprob, and the most likely tokens and the token itself in `top_logprobs` (as the
    /// OpenAI API gives them: up to `logprobs` + 1 entries).
    fn add_logprob(&mut self, index: usize, lp: &TokenLogprob) {
        let (token, _) = token_text(&self.tokenizer, lp.token);
        let mut top = Map::new();
        for &(id, logprob) in &lp.top {
            let (text, _) = token_text(&self.tokenizer, id);
            top.entry(text).or_insert(Json::from(logprob as f64));
        }
        top.entry(token.clone()).or_insert(Json::from(lp.logprob as f64));
        self.push_entry(index, token, Some(lp.logprob as f64), Some(top));
    }

    /// The prompt's tokens (with `echo`): the first without a logprob, then each with its own.
    fn add_prompt_logprobs(&mut self, index: usize, first_token: u32, logprobs: &[TokenLogprob]) {
        let (first, _) = token_text(&self.tokenizer, first_token);
        self.push_entry(index, first, None, None);
        for lp in logprobs {
            self.add_logprob(index, lp);
        }
    }

    fn push_entry(&mut self, index: usize, token: String, logprob: Option<f64>, top: Option<Map<String, Json>>) {
        let p = &mut self.pending[index];
        p.text_offset.push(self.offsets[index]);
        self.offsets[index] += token.chars().count();
        p.tokens.push(token);
        p.token_logprobs.push(logprob);
        p.top_logprobs.push(top);
    }

    fn chunk(&self, choices: Vec<CompletionChoice>, usage: Option<Usage>) -> Completion {
        Completion {
            id: self.id.clone(),
            object: "text_completion",
            created: self.created,
            model: self.model.clone(),
            system_fingerprint: None,
            choices,
            usage: self.include_usage.then_some(usage),
        }
    }

    fn text_chunk(&mut self, index: usize, text: String, finish_reason: Option<&'static str>) -> Completion {
        let logprobs = if self.logprobs && !self.pending[index].tokens.is_empty() {
            Some(std::mem::take(&mut self.pending[index]))
        } else {
            None
        };
        self.chunk(
            vec![CompletionChoice {
                index,
                text,
                logprobs,
                finish_reason,
            }],
            None,
        )
    }

    fn start_text(&mut self, index: usize) -> String {
        if self.started[index] {
            return String::new();
        }
        self.started[index] = true;
        self.echo[index].as_deref().unwrap_or_default().to_string()
    }

    pub fn stream_event(&mut self, event: Event) -> (Vec<String>, bool) {
        let mut out = Vec::new();
        match event {
            Event::Token { index, deltas, logprob } => {
                if let Some(lp) = logprob {
                    self.add_logprob(index, &lp);
                }
                let mut text = self.start_text(index);
                text.push_str(&content_of(deltas));
                if !text.is_empty() {
                    out.push(self.text_chunk(index, text, None));
                }
            }
            Event::PromptLogprobs {
                index,
                first_token,
                logprobs,
            } => {
                self.add_prompt_logprobs(index, first_token, &logprobs);
                let text = self.start_text(index);
                out.push(self.text_chunk(index, text, None));
            }
            Event::Finished {
                index,
                output,
                cached_tokens,
            } => {
                self.cached_tokens += cached_tokens;
                let mut text = self.start_text(index);
                text.push_str(&content_of(output.deltas));
                self.completion_tokens += output.completion_tokens;
                out.push(self.text_chunk(index, text, Some(output.finish_reason.as_str())));
            }
            Event::Done => {
                let mut data: Vec<String> = out.iter().map(crate::chat::to_json).collect();
                if self.include_usage {
                    let usage = Usage::new(self.prompt_tokens, self.completion_tokens, self.cached_tokens, 0);
                    data.push(crate::chat::to_json(&self.chunk(Vec::new(), Some(usage))));
                }
                data.push("[DONE]".into());
                return (data, true);
            }
            Event::Error(error) => return (vec![crate::chat::to_json(&error.body()), "[DONE]".into()], true),
        }
        (out.iter().map(crate::chat::to_json).collect(), false)
    }

    pub fn collect_event(&mut self, event: Event) -> Option<Result<Completion, ApiError>> {
        match event {
            Event::Token { index, logprob, .. } => {
                if let Some(lp) = logprob {
                    self.add_logprob(index, &lp);
                }
                None
            }
            Event::PromptLogprobs {
                index,
                first_token,
                logprobs,
            } => {
                self.add_prompt_logprobs(index, first_token, &logprobs);
                None
            }
            Event::Finished {
                index,
                output,
                cached_tokens,
            } => {
                self.cached_tokens += cached_tokens;
                self.completion_tokens += output.completion_tokens;
                self.texts[index] = format!("{}{}", self.echo[index].as_deref().unwrap_or(""), output.content);
                self.finish[index] = Some(output.finish_reason.as_str());
                None
            }
            Event::Error(error) => Some(Err(error)),
            Event::Done => {
                let choices = (0..self.texts.len())
                    .map(|index| CompletionChoice {
                        index,
                        text: std::mem::take(&mut self.texts[index]),
                        logprobs: self.logprobs.then(|| std::mem::take(&mut self.pending[index])),
                        finish_reason: self.finish[index],
                    })
                    .collect();
                let mut completion = self.chunk(choices, None);
                completion.usage = Some(Some(Usage::new(
                    self.prompt_tokens,
                    self.completion_tokens,
                    self.cached_tokens,
                    0,
                )));
                Some(Ok(completion))
            }
        }
    }
}

fn content_of(deltas: Vec<Delta>) -> String {
    deltas
        .into_iter()
        .filter_map(|d| match d {
            Delta::Content(text) => Some(text),
            _ => None,
        })
        .collect()
}
