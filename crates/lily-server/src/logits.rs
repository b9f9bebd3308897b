//! What the server does to a copy of the logits before sampling: logit bias, presence/frequency penalties (over
//! the generated tokens, as OpenAI and vLLM define them) and the repetition penalty (over prompt and generated
//! tokens, as Hugging Face and vLLM define it); and log-probabilities (log-softmax) for `logprobs`.

use std::collections::HashMap;

#[derive(Debug, Clone, Default, PartialEq)]
pub struct Penalties {
    /// Subtracted once from the logit of every token generated at least once. OpenAI range [-2, 2].
    pub presence: f32,
    /// Subtracted from a token's logit once per time it was generated. OpenAI range [-2, 2].
    pub frequency: f32,
    /// 1 is off; > 1 discourages tokens seen in the prompt or output: a positive logit is divided by it, a
    /// negative one multiplied.
    pub repetition: f32,
    /// Added to the logits of the given token ids.
    pub logit_bias: Vec<(u32, f32)>,
}

impl Penalties {
    pub fn none() -> Penalties {
        Penalties {
            presence: 0.0,
            frequency: 0.0,
            repetition: 1.0,
            logit_bias: Vec::new(),
        }
    }

    pub fn is_active(&self) -> bool {
        self.reads_history() || !self.logit_bias.is_empty()
    }

    /// Whether a penalty reads the sequence's tokens (repetition, presence, frequency).
    pub fn reads_history(&self) -> bool {
        self.presence != 0.0 || self.frequency != 0.0 || self.repetition != 1.0
    }
}

/// Per-sequence token history for the penalties; empty, and not kept, when the request has none that reads it.
#[derive(Debug, Default)]
pub struct History {
    /// How often each token was generated.
    generated: HashMap<u32, u32>,
    /// Tokens of the prompt (for the repetition penalty).
    prompt: std::collections::HashSet<u32>,
    /// Whether a penalty reads the generated tokens ([`Penalties::reads_history`]).
    kept: bool,
}

impl History {
    pub fn new(prompt: &[u32], penalties: &Penalties) -> History {
        let prompt = if penalties.repetition != 1.0 {
            prompt.iter().copied().collect()
        } else {
            Default::default()
        };
        History {
            generated: HashMap::new(),
            prompt,
            kept: penalties.reads_history(),
        }
    }

    pub fn push(&mut self, token: u32) {
        if self.kept {
            *self.generated.entry(token).or_insert(0) += 1;
        }
    }
}

/// Applies the penalties in place, in vLLM's order: repetition, then frequency and presence, then the bias.
pub fn apply(logits: &mut [f32], penalties: &Penalties, history: &History) {
    if penalties.repetition != 1.0 {
        let r = penalties.repetition;
        let seen = history.prompt.iter().copied().chain(history.generated.keys().copied());
        let mut done = std::collections::HashSet::new();
        for token in seen {
            if !done.insert(token) {
                continue;
            }
            if let Some(l) = logits.get_mut(token as usize) {
                *l = if *l > 0.0 { *l / r } else { *l * r };
            }
        }
    }
    if penalties.presence != 0.0 || penalties.frequency != 0.0 {
        for (&token, &count) in &history.generated {
            if let Some(l) = logits.get_mut(token as usize) {
                *l -= penalties.frequency * count as f32 + penalties.presence;
            }
        }
    }
    for &(token, bias) in &penalties.logit_bias {
        if let Some(l) = logits.get_mut(token as usize) {
            *l += bias;
        }
    }
}

/// The chosen token's log-probability and the `top` most likely tokens with theirs.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// Log-softmax of `logits` at `token`, and the `top` largest entries (ties: lower id first).
pub fn logprobs(logits: &[f32], token: u32, top: usize) -> TokenLogprob {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| ((l - max) as f64).exp()).sum();
    let log_z = max as f64 + sum.ln();
    let lp = |l: f32| (l as f64 - log_z) as f32;
    let mut best: Vec<(u32, f32)> = Vec::new();
    if top > 0 {
        let mut indexed: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, &l)| (i as u32, l)).collect();
        let order = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        let k = top.min(indexed.len());
        if k < indexed.len() {
            indexed.select_nth_unstable_by(k - 1, order);
            indexed.truncate(k);
        }
        indexed.sort_unstable_by(order);
        best = indexed.into_iter().map(|(i, l)| (i, lp(l))).collect();
    }
    TokenLogprob {
        token,
        logprob: lp(logits[token as usize]),
        top: best,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_softmax_and_top() {
        let logits = [0.0, (2.0f32).ln(), (3.0f32).ln(), (2.0f32).ln()];
        let lp = logprobs(&logits, 1, 3);
        assert!((lp.logprob - (2.0f32 / 8.0).ln()).abs() < 1e-5);
        assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![2, 1, 3]);
        assert!((lp.top[0].1 - (3.0f32 / 8.0).ln()).abs() < 1e-5);
        assert!(logprobs(&logits, 0, 0).top.is_empty());
    }

    #[test]
    fn penalties_follow_openai_and_hf() {
        let p = Penalties {
            presence: 0.5,
            frequency: 0.25,
            repetition: 2.0,
            logit_bias: vec![(3, -100.0)],
        };
        let mut h = History::new(&[0], &p);
        h.push(1);
        h.push(1);
        let mut logits = [4.0, -4.0, 1.0, 1.0];
        apply(&mut logits, &p, &h);
        // token 0: prompt only -> repetition 4/2 = 2; token 1: -4*2 = -8, then -(0.25*2 + 0.5) = -9.
        assert_eq!(logits, [2.0, -9.0, 1.0, -99.0]);
        assert!(!Penalties::none().is_active());
    }

    #[test]
    fn the_history_is_kept_only_for_penalties_that_read_it() {
        let bias_only = Penalties {
            logit_bias: vec![(2, 5.0)],
            ..Penalties::none()
        };
        let mut h = History::new(&[0], &bias_only);
        h.push(1);
        let mut logits = [0.0, 1.0, 1.0];
        apply(&mut logits, &bias_only, &h);
        assert_eq!(logits, [0.0, 1.0, 6.0]);
        assert!(h.generated.is_empty(), "no penalty reads the generated tokens");

        let frequency = Penalties {
            frequency: 1.0,
            ..Penalties::none()
        };
        let mut h = History::new(&[0], &frequency);
        h.push(1);
        h.push(1);
        let mut logits = [0.0, 1.0, 1.0];
        apply(&mut logits, &frequency, &h);
        assert_eq!(logits, [0.0, -1.0, 1.0]);
    }
}
