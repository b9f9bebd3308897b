//! Validation of the sampling fields that chat and completions share, with OpenAI's ranges; each bad value is a
//! 400 naming its field. The sampler's own parameters are checked by `SamplingParams::validate`, here as
//! everywhere else.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use lily_model::sampling::SamplingParams;

use crate::error::ApiError;
use crate::logits::Penalties;
use crate::types::{RawSampling, StopField};

/// Sampling defaults when a request leaves a field out: the model directory's `generation_config.json` where it
/// has them (as vLLM does), else OpenAI's (temperature 1, no top-p/top-k/min-p limit).
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationDefaults {
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: usize,
    pub min_p: f32,
    pub repetition_penalty: f32,
}

impl Default for GenerationDefaults {
    fn default() -> Self {
        GenerationDefaults {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            repetition_penalty: 1.0,
        }
    }
}

impl GenerationDefaults {
    pub fn from_dir(dir: &Path) -> GenerationDefaults {
        let mut d = GenerationDefaults::default();
        let config = match lily_model::config::GenerationConfig::from_dir(dir) {
            Ok(Some(config)) => config,
            Ok(None) => return d,
            Err(error) => {
                tracing::warn!("ignoring generation_config.json: {error}");
                return d;
            }
        };
        d.temperature = config.temperature.unwrap_or(d.temperature);
        d.top_p = config.top_p.unwrap_or(d.top_p);
        d.top_k = config.top_k.unwrap_or(d.top_k);
        d.min_p = config.min_p.unwrap_or(d.min_p);
        d.repetition_penalty = config.repetition_penalty.unwrap_or(d.repetition_penalty);
        d
    }
}

#[derive(Debug, Clone)]
pub struct Sampling {
    /// The seed of choice `i` is `seed + i`.
    pub params: SamplingParams,
    pub penalties: Penalties,
    pub stop: Vec<String>,
    pub n: usize,
}

/// The most choices a prompt may ask for (OpenAI's limit); `--max-choices` bounds a request's prompts x `n`.
pub const MAX_N: usize = 128;
pub const MAX_TOP_LOGPROBS: usize = 20;
/// Most stop strings a request may give, and the most bytes of each: every generated token is searched for each of
/// them, so an unbounded list would slow every stream of the server (OpenAI's API takes 4).
pub const MAX_STOP_STRINGS: usize = 32;
pub const MAX_STOP_BYTES: usize = 1024;

pub fn validate(raw: RawSampling, defaults: &GenerationDefaults, vocab_size: usize) -> Result<Sampling, ApiError> {
    let top_k = match raw.top_k {
        None => defaults.top_k,
        // vLLM's spelling of "no limit".
        Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => k as usize,
        Some(k) => {
            return Err(ApiError::invalid(
                "top_k",
                format!("`top_k` must be >= 0 (or -1 for no limit), got {k}"),
            ))
        }
    };
    let penalty = |name: &str, value: Option<f32>| -> Result<f32, ApiError> {
        let v = value.unwrap_or(0.0);
        if !(-2.0..=2.0).contains(&v) {
            return Err(ApiError::invalid(name, format!("`{name}` must be in [-2, 2], got {v}")));
        }
        Ok(v)
    };
    let presence = penalty("presence_penalty", raw.presence_penalty)?;
    let frequency = penalty("frequency_penalty", raw.frequency_penalty)?;
    let repetition = raw.repetition_penalty.unwrap_or(defaults.repetition_penalty);
    if !(repetition.is_finite() && repetition > 0.0) {
        return Err(ApiError::invalid(
            "repetition_penalty",
            format!("`repetition_penalty` must be a number > 0 (1 is off), got {repetition}"),
        ));
    }
    let mut logit_bias = Vec::new();
    for (key, value) in raw.logit_bias.unwrap_or_default() {
        // Only plain digits: `str::parse` would also take "+5".
        let token: u32 = Some(&key)
            .filter(|k| !k.is_empty() && k.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|k| k.parse().ok())
            .filter(|&t: &u32| (t as usize) < vocab_size)
            .ok_or_else(|| {
                ApiError::invalid(
                    "logit_bias",
                    format!("`logit_bias` key {key:?} is not a token id below {vocab_size}"),
                )
            })?;
        let bias = value.as_f64().filter(|b| (-100.0..=100.0).contains(b)).ok_or_else(|| {
            ApiError::invalid(
                "logit_bias",
                format!("`logit_bias` values must be numbers in [-100, 100], got {value}"),
            )
        })?;
        logit_bias.push((token, bias as f32));
    }
    let n = match raw.n {
        None => 1,
        Some(n) if n >= 1 && n as usize <= MAX_N => n as usize,
        Some(n) => {
            return Err(ApiError::invalid(
                "n",
                format!("`n` must be between 1 and {MAX_N}, got {n}"),
            ))
        }
    };
    let seed = match raw.seed {
        Some(seed) => seed as u64,
        None => random_u64(),
    };
    let stop = raw.stop.map(StopField::into_vec).unwrap_or_default();
    if stop.len() > MAX_STOP_STRINGS {
        return Err(ApiError::invalid(
            "stop",
            format!("`stop` may hold at most {MAX_STOP_STRINGS} strings, got {}", stop.len()),
        ));
    }
    if let Some(long) = stop.iter().find(|s| s.len() > MAX_STOP_BYTES) {
        return Err(ApiError::invalid(
            "stop",
            format!(
                "a stop string may be at most {MAX_STOP_BYTES} bytes long, got one of {} bytes",
                long.len()
            ),
        ));
    }
    let params = SamplingParams {
        temperature: raw.temperature.unwrap_or(defaults.temperature),
        top_k,
        top_p: raw.top_p.unwrap_or(defaults.top_p),
        min_p: raw.min_p.unwrap_or(defaults.min_p),
        seed,
    }
    .validate()
    .map_err(|e| ApiError::invalid(e.param(), e.to_string()))?;
    Ok(Sampling {
        params,
        penalties: Penalties {
            presence,
            frequency,
            repetition,
            logit_bias,
        },
        stop,
        n,
    })
}

/// `max_tokens` (or `max_completion_tokens`) checked against the context: the prompt plus the tokens to generate
/// must fit. Without a limit the rest of the context is the limit. `least` is the smallest value allowed: 1, or 0
/// where a request may ask for no tokens at all (a completion that echoes its prompt, to score it).
pub fn max_tokens(
    requested: Option<i64>,
    least: i64,
    param: &str,
    prompt_param: &str,
    prompt_len: usize,
    context: usize,
) -> Result<usize, ApiError> {
    if prompt_len >= context {
        return Err(ApiError::invalid(
            prompt_param,
            format!(
                "The prompt is {prompt_len} tokens long, but the context holds {context} tokens (prompt and \
                 completion together); shorten the prompt."
            ),
        )
        .with_code("context_length_exceeded"));
    }
    let room = context - prompt_len;
    match requested {
        None => Ok(room),
        Some(m) if m < least => Err(ApiError::invalid(
            param,
            format!("`{param}` must be at least {least}, got {m}"),
        )),
        Some(m) if m as u64 > room as u64 => Err(ApiError::invalid(
            param,
            format!(
                "`{param}` is {m}, but the prompt ({prompt_len} tokens) leaves room for only {room} tokens in the \
                 context of {context} tokens."
            ),
        )
        .with_code("context_length_exceeded")),
        Some(m) => Ok(m as usize),
    }
}

/// A random 64-bit number (seeds, ids) from the standard library's randomly keyed hasher.
pub fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish()
}

/// An id as an error message shows it: its first 64 characters (ids the server gives are shorter).
pub fn shown_id(id: &str) -> &str {
    id.char_indices().nth(64).map_or(id, |(end, _)| &id[..end])
}

/// `prefix` followed by 24 random lowercase letters and digits, like OpenAI's ids.
pub fn random_id(prefix: &str) -> String {
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut out = String::from(prefix);
    let (mut a, mut b) = (random_u64(), random_u64());
    for i in 0..24 {
        let word = if i < 12 { &mut a } else { &mut b };
        out.push(ALPHABET[(*word % 36) as usize] as char);
        *word /= 36;
    }
    out
}

pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
