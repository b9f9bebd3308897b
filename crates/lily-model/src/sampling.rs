//! Choosing the next token from logits: greedy, or seeded sampling with temperature, top-k, top-p and min-p
//! (applied in that order, as vLLM and HF do). `SamplingParams::validate` is the one check of their ranges, used
//! by the server, the command line and a model's generation_config.json alike.

use crate::rng::Rng;

/// Temperatures below this are greedy: dividing logits by a smaller one overflows to infinities (and NaN
/// probabilities), and the distribution is all but greedy there anyway (vLLM draws the line at the same value).
pub const MIN_TEMPERATURE: f32 = 1e-5;

#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 (or anything below `MIN_TEMPERATURE`) means greedy.
    pub temperature: f32,
    /// 0 means no limit.
    pub top_k: usize,
    /// 1 means no limit; 0 keeps only the most likely token (greedy).
    pub top_p: f32,
    /// 0 means no limit.
    pub min_p: f32,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 0,
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SamplingError {
    #[error("temperature must be a finite number >= 0, got {0}")]
    Temperature(f32),
    #[error("top_p must be in [0, 1], got {0}")]
    TopP(f32),
    #[error("min_p must be in [0, 1], got {0}")]
    MinP(f32),
}

impl SamplingError {
    /// The parameter's name, as the OpenAI API and the command line spell it.
    pub fn param(&self) -> &'static str {
        match self {
            SamplingError::Temperature(_) => "temperature",
            SamplingError::TopP(_) => "top_p",
            SamplingError::MinP(_) => "min_p",
        }
    }
}

impl SamplingParams {
    /// Checks every range, and returns the parameters as the samplers use them: a temperature below
    /// `MIN_TEMPERATURE` becomes 0 (greedy).
    pub fn validate(mut self) -> Result<SamplingParams, SamplingError> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(SamplingError::Temperature(self.temperature));
        }
        if !(0.0..=1.0).contains(&self.top_p) {
            return Err(SamplingError::TopP(self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(SamplingError::MinP(self.min_p));
        }
        if self.temperature < MIN_TEMPERATURE {
            self.temperature = 0.0;
        }
        Ok(self)
    }

    /// Whether these parameters always choose the most likely token. A top-p of 0 does: the smallest run of the
    /// most likely tokens whose probability reaches 0 is the most likely token alone (the OpenAI API takes 0).
    pub fn is_greedy(&self) -> bool {
        self.temperature < MIN_TEMPERATURE || self.top_k == 1 || self.top_p == 0.0
    }
}

/// A value as the choices of the largest rank it ([`argmax`], the router's top-k): a NaN as negative infinity, so
/// every value has a place in the order and a row of NaNs chooses its lowest index. The GPU kernels' `rank_value`
/// ranks the same way. (`argmax` gets this order without calling it on every logit; a test checks that they agree.)
pub fn rank_value(l: f32) -> f32 {
    if l.is_nan() {
        f32::NEG_INFINITY
    } else {
        l
    }
}

/// Index of the largest logit (the lowest index among equals; a NaN ranks as negative infinity).
pub fn argmax(logits: &[f32]) -> u32 {
    // A NaN never compares greater, so from a first value that is a number the plain comparison passes over every
    // NaN as it would negative infinity. Where the largest is negative infinity, all rank equal and the first wins.
    let Some(start) = logits.iter().position(|l| !l.is_nan()) else {
        return 0;
    };
    let mut best = start;
    for (i, &l) in logits.iter().enumerate().skip(start + 1) {
        if l > logits[best] {
            best = i;
        }
    }
    match logits[best] == f32::NEG_INFINITY {
        true => 0,
        false => best as u32,
    }
}

/// Keeps only the tokens a mask allows: bit `t % 32` of word `t / 32` allows token `t`; every other logit (the
/// tokens past the mask's end too) becomes negative infinity. Constrained decoding computes the mask.
pub fn apply_token_mask(logits: &mut [f32], allowed: &[u32]) {
    for (i, logit) in logits.iter_mut().enumerate() {
        let word = allowed.get(i / 32).copied().unwrap_or(0);
        if word & (1 << (i % 32)) == 0 {
            *logit = f32::NEG_INFINITY;
        }
    }
}

pub struct Sampler {
    params: SamplingParams,
    rng: Rng,
    /// Candidate (token, probability) pairs, reused between steps.
    candidates: Vec<(u32, f32)>,
}

thread_local! {
    /// Each token's `exp(logit / temperature - max)` for a draw from the whole vocabulary: one buffer a thread,
    /// reused by every sampler drawn there, so a live request holds no vocabulary-sized buffer for it.
    static WEIGHTS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Sampler {
        let rng = Rng::new(params.seed);
        Sampler {
            params,
            rng,
            candidates: Vec::new(),
        }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Takes the next draw of the sampler's random stream for a device to make (a GPU sampler draws
    /// `uniform_at(seed, 0, index)` as `sample` would here) and returns its index. Greedy parameters draw nothing.
    pub fn next_draw(&mut self) -> u64 {
        self.rng.advance()
    }

    /// Gives back the draw [`Sampler::next_draw`] took, for a device that left the row to the host: the next
    /// `sample` here then makes that draw.
    pub fn return_draw(&mut self) {
        self.rng.retreat();
    }

    /// Samples among the tokens the mask allows ([`apply_token_mask`], applied to `logits` in place). The mask
    /// must allow at least one token.
    pub fn sample_masked(&mut self, logits: &mut [f32], allowed: &[u32]) -> u32 {
        apply_token_mask(logits, allowed);
        self.sample(logits)
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let p = &self.params;
        if p.is_greedy() {
            return argmax(logits);
        }
        let whole = p.top_k == 0 || p.top_k >= logits.len();
        if whole && p.top_p >= 1.0 && p.min_p <= 0.0 {
            return self.sample_whole(logits);
        }
        let c = &mut self.candidates;
        c.clear();
        c.extend(logits.iter().enumerate().map(|(i, &l)| (i as u32, l / p.temperature)));
        // The candidates in order, most likely first: the `top_k`, or, without a top-k, the shortest run of the
        // most likely that holds what `top_p` and `min_p` keep. That run is found by sorting a head of the
        // vocabulary, eight times longer each time it falls short, rather than sorting the whole vocabulary for
        // every token (on the host, most of a sampled step's time).
        let mut total = None;
        if !whole {
            sort_head(c, p.top_k);
            c.truncate(p.top_k);
        } else {
            let max = c.iter().map(|cand| cand.1).fold(f32::NEG_INFINITY, f32::max);
            let sum = softmax_total(c, max);
            total = Some(sum);
            let mut head = HEAD.min(c.len());
            loop {
                sort_head(c, head);
                if head == c.len() || holds_kept(&c[..head], max, sum, p.top_p, p.min_p) {
                    c.truncate(head);
                    break;
                }
                head = (head * 8).min(c.len());
            }
        }
        let max = c[0].1;
        if max == f32::INFINITY {
            // A temperature so small that dividing by it overflows: the distribution is all on the largest logit
            // (and the softmax below would be NaN).
            return argmax(logits);
        }
        for cand in c.iter_mut() {
            cand.1 = (cand.1 - max).exp();
        }
        let total = total.unwrap_or_else(|| c.iter().map(|cand| cand.1 as f64).sum());
        for cand in c.iter_mut() {
            cand.1 = (cand.1 as f64 / total) as f32;
        }
        if p.top_p < 1.0 {
            let mut cumulative = 0.0;
            let mut keep = c.len();
            for (i, cand) in c.iter().enumerate() {
                cumulative += cand.1;
                if cumulative >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
            c.truncate(keep);
        }
        if p.min_p > 0.0 {
            let threshold = c[0].1 * p.min_p;
            c.retain(|cand| cand.1 >= threshold);
        }
        let kept: f32 = c.iter().map(|cand| cand.1).sum();
        let mut r = self.rng.uniform() * kept;
        for cand in c.iter() {
            if r < cand.1 {
                return cand.0;
            }
            r -= cand.1;
        }
        c.last().unwrap().0
    }

    /// A draw from the softmax of the whole vocabulary at the sampler's temperature, without sorting: with nothing
    /// cut off, the order in which tokens take their share of the draw does not change the distribution. Each token's
    /// weight `exp(logit / temperature - max)` is computed once (in the thread's [`WEIGHTS`]) and summed in f64 over
    /// runs of [`WHOLE_RUN`] consecutive tokens; the uniform times the runs' total walks the runs in order, then the
    /// chosen run's tokens. The GPU sampler (`sample_rows`) draws with the same arithmetic in the same order, one run
    /// a thread, so both pick the same token.
    fn sample_whole(&mut self, logits: &[f32]) -> u32 {
        let temperature = self.params.temperature;
        let max = logits
            .iter()
            .map(|&l| l / temperature)
            .fold(f32::NEG_INFINITY, f32::max);
        if max == f32::INFINITY {
            return argmax(logits);
        }
        let rng = &mut self.rng;
        let drawn = WEIGHTS.with_borrow_mut(|weights| {
            weights.clear();
            weights.extend(logits.iter().map(|&l| (l / temperature - max).exp()));
            let runs = || weights.chunks(WHOLE_RUN);
            let total = runs().fold(0.0f64, |total, run| total + run_sum(run.iter().copied()));
            let mut r = rng.uniform() as f64 * total;
            // Each run's sum again on the walk (the same additions, so the same bits), rather than kept per draw.
            for (i, run) in runs().enumerate() {
                let sum = run_sum(run.iter().copied());
                if r < sum {
                    for (j, &w) in run.iter().enumerate() {
                        let w = w as f64;
                        if r < w {
                            return Some((i * WHOLE_RUN + j) as u32);
                        }
                        r -= w;
                    }
                    return None;
                }
                r -= sum;
            }
            None
        });
        // Rounding can leave a sliver of the draw past the last token (of the run, or of all): it goes to the most
        // likely one.
        drawn.unwrap_or_else(|| argmax(logits))
    }
}

/// Tokens a run of the softmax's sums over the whole vocabulary ([`Sampler::sample_whole`], and the total of a
/// top-p or min-p draw without a top-k): the GPU sampler's `WHOLE_RUN` (kernels/sampling.cu), which takes a run a
/// thread.
pub const WHOLE_RUN: usize = 256;

/// The tokens a search for what `top_p` and `min_p` keep starts from: a real model's nucleus is almost always
/// within its few hundred most likely tokens. The GPU sampler's `SAMPLE_HEAD` is the same: it takes the rows whose
/// search ends in the first head and leaves the others to the host.
pub const HEAD: usize = 256;

/// Puts the `head` most likely candidates first, in order: the larger scaled logit first, then the lower id (the GPU
/// sampler's candidate keys rank them the same way).
fn sort_head(candidates: &mut [(u32, f32)], head: usize) {
    let by_logit_desc = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    if head < candidates.len() {
        candidates.select_nth_unstable_by(head - 1, by_logit_desc);
    }
    candidates[..head].sort_unstable_by(by_logit_desc);
}

/// A run's weights summed in f64 in order, as a thread of the GPU sampler sums its run.
fn run_sum(weights: impl Iterator<Item = f32>) -> f64 {
    weights.fold(0.0f64, |sum, w| sum + w as f64)
}

/// The sum of `exp(scaled - max)` over the candidates in token order, in f64 over runs of [`WHOLE_RUN`], then the
/// runs' sums: the order `sample_whole` sums in and the GPU sampler repeats.
fn softmax_total(candidates: &[(u32, f32)], max: f32) -> f64 {
    candidates.chunks(WHOLE_RUN).fold(0.0f64, |total, run| {
        total + run_sum(run.iter().map(|cand| (cand.1 - max).exp()))
    })
}

/// Whether a draw with `params` but no top-k finds what its `top_p` and `min_p` keep among the [`HEAD`] most likely
/// tokens of `logits` (masked ones at negative infinity): the rows the GPU sampler draws itself; it leaves the
/// others to the host.
pub fn kept_within_head(params: &SamplingParams, logits: &[f32]) -> bool {
    if logits.len() <= HEAD {
        return true;
    }
    let mut c: Vec<(u32, f32)> = (logits.iter().enumerate())
        .map(|(i, &l)| (i as u32, l / params.temperature))
        .collect();
    let max = c.iter().map(|cand| cand.1).fold(f32::NEG_INFINITY, f32::max);
    let sum = softmax_total(&c, max);
    sort_head(&mut c, HEAD);
    holds_kept(&c[..HEAD], max, sum, params.top_p, params.min_p)
}

/// Whether `head`, the most likely candidates in order (logits divided by the temperature), holds every candidate
/// that `top_p` and `min_p` keep, given the largest of all the candidates' scaled logits `max` and the sum `total`
/// of their `exp(logit - max)`: `top_p`'s run ends inside it, and its last candidate is below `min_p`'s threshold.
fn holds_kept(head: &[(u32, f32)], max: f32, total: f64, top_p: f32, min_p: f32) -> bool {
    let prob = |cand: &(u32, f32)| ((cand.1 - max).exp() as f64 / total) as f32;
    let Some(last) = head.last() else {
        return true;
    };
    let top_p_inside = top_p >= 1.0 || {
        let mut cumulative = 0.0f32;
        head.iter().any(|cand| {
            cumulative += prob(cand);
            cumulative >= top_p
        })
    };
    let min_p_inside = min_p <= 0.0 || prob(last) < prob(&head[0]) * min_p;
    // With both, what top_p keeps is cut further by min_p, so either ending inside the head is enough.
    match (top_p < 1.0, min_p > 0.0) {
        (true, true) => top_p_inside || min_p_inside,
        (true, false) => top_p_inside,
        (false, true) => min_p_inside,
        (false, false) => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: usize, top_p: f32, min_p: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            min_p,
            seed: 42,
        }
    }

    #[test]
    fn greedy_takes_the_first_maximum() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 0.0]), 1);
        assert_eq!(Sampler::new(params(0.0, 0, 1.0, 0.0)).sample(&[0.0, 5.0, 1.0]), 1);
    }

    #[test]
    fn greedy_ranks_a_nan_as_negative_infinity() {
        let nan = f32::NAN;
        assert_eq!(argmax(&[nan, -3.0, nan, 1.0]), 3);
        assert_eq!(argmax(&[nan, nan, nan]), 0);
        assert_eq!(argmax(&[f32::NEG_INFINITY, nan, f32::NEG_INFINITY]), 0);
        assert_eq!(argmax(&[nan, f32::NEG_INFINITY, 2.0]), 2);
        assert_eq!(argmax(&[nan, f32::NEG_INFINITY]), 0);
        // Against the rule written out (the largest rank_value, the lowest index among equals) on short rows of
        // NaNs, infinities and a few numbers with many ties.
        let values = [nan, f32::NEG_INFINITY, f32::INFINITY, -1.0, 0.0, 1.0];
        let mut rng = crate::rng::Rng::new(7);
        for _ in 0..5000 {
            let len = 1 + (rng.next_u64() % 6) as usize;
            let row: Vec<f32> = (0..len).map(|_| values[(rng.next_u64() % 6) as usize]).collect();
            let mut want = 0;
            for (i, &l) in row.iter().enumerate() {
                if rank_value(l) > rank_value(row[want]) {
                    want = i;
                }
            }
            assert_eq!(argmax(&row), want as u32, "{row:?}");
        }
    }

    #[test]
    fn filters_restrict_the_support() {
        let logits = [2.0, 1.9, 0.0, -1.0, 1.8];
        let draw = |p: SamplingParams| {
            let mut s = Sampler::new(p);
            (0..2000)
                .map(|_| s.sample(&logits))
                .collect::<std::collections::BTreeSet<u32>>()
        };
        assert_eq!(draw(params(1.0, 2, 1.0, 0.0)), [0, 1].into());
        assert_eq!(draw(params(1.0, 0, 1.0, 0.5)), [0, 1, 4].into());
        assert_eq!(draw(params(1.0, 0, 0.3, 0.0)), [0].into());
        assert_eq!(draw(params(1.0, 0, 1.0, 0.0)), [0, 1, 2, 3, 4].into());
    }

    #[test]
    fn same_seed_same_tokens_and_frequencies_follow_the_softmax() {
        let logits = [0.0, (2.0f32).ln(), (3.0f32).ln()];
        let run = |seed| {
            let mut s = Sampler::new(SamplingParams {
                seed,
                ..params(1.0, 0, 1.0, 0.0)
            });
            (0..6000).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
        let draws = run(7);
        for (token, expected) in [(0, 1.0 / 6.0), (1, 2.0 / 6.0), (2, 3.0 / 6.0)] {
            let freq = draws.iter().filter(|&&t| t == token).count() as f64 / draws.len() as f64;
            assert!((freq - expected).abs() < 0.03, "token {token}: {freq}");
        }
    }

    #[test]
    fn whole_softmax_draws_follow_it_across_runs() {
        // Three tokens in three different runs of the draw's sums, the rest impossible.
        let mut logits = vec![f32::NEG_INFINITY; 3 * WHOLE_RUN + 5];
        let tokens = [10, WHOLE_RUN + 44, 3 * WHOLE_RUN + 4];
        for (&token, weight) in tokens.iter().zip([1.0f32, 2.0, 3.0]) {
            logits[token] = weight.ln();
        }
        let mut s = Sampler::new(SamplingParams {
            seed: 5,
            ..params(1.0, 0, 1.0, 0.0)
        });
        let draws: Vec<u32> = (0..6000).map(|_| s.sample(&logits)).collect();
        for (&token, expected) in tokens.iter().zip([1.0 / 6.0, 2.0 / 6.0, 3.0 / 6.0]) {
            let freq = draws.iter().filter(|&&t| t as usize == token).count() as f64 / draws.len() as f64;
            assert!((freq - expected).abs() < 0.03, "token {token}: {freq}");
        }
        assert!(draws.iter().all(|t| tokens.contains(&(*t as usize))));
    }

    #[test]
    fn kept_within_head_finds_peaked_nuclei_only() {
        let p = |top_p, min_p| params(1.0, 0, top_p, min_p);
        let mut peaked = vec![0.0f32; 5000];
        peaked[1234] = 20.0;
        assert!(kept_within_head(&p(0.9, 0.0), &peaked));
        assert!(kept_within_head(&p(1.0, 0.05), &peaked));
        // A flat softmax keeps 90% of 5,000 tokens, and every token is above 5% of the largest.
        let flat = vec![0.0f32; 5000];
        assert!(!kept_within_head(&p(0.9, 0.0), &flat));
        assert!(!kept_within_head(&p(1.0, 0.05), &flat));
        // A vocabulary no longer than the head is all inside it.
        assert!(kept_within_head(&p(0.9, 0.0), &flat[..HEAD]));
    }

    /// The sampler as it was before its head search: every candidate sorted, for every draw.
    fn sample_by_full_sort(p: &SamplingParams, rng: &mut Rng, logits: &[f32]) -> u32 {
        let mut c: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, l / p.temperature))
            .collect();
        c.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let max = c[0].1;
        let mut total = 0.0f64;
        for cand in c.iter_mut() {
            cand.1 = (cand.1 - max).exp();
            total += cand.1 as f64;
        }
        for cand in c.iter_mut() {
            cand.1 = (cand.1 as f64 / total) as f32;
        }
        if p.top_p < 1.0 {
            let mut cumulative = 0.0;
            let keep = c.iter().position(|cand| {
                cumulative += cand.1;
                cumulative >= p.top_p
            });
            c.truncate(keep.map_or(c.len(), |i| i + 1));
        }
        if p.min_p > 0.0 {
            let threshold = c[0].1 * p.min_p;
            c.retain(|cand| cand.1 >= threshold);
        }
        let kept: f32 = c.iter().map(|cand| cand.1).sum();
        let mut r = rng.uniform() * kept;
        for cand in c.iter() {
            if r < cand.1 {
                return cand.0;
            }
            r -= cand.1;
        }
        c.last().unwrap().0
    }

    #[test]
    fn top_p_and_min_p_without_a_top_k_draw_as_a_full_sort_would() {
        // Peaked logits (a nucleus inside the first head), flat ones (the head grows to the whole vocabulary) and
        // ties, over a vocabulary of 5,000.
        let mut rng = Rng::new(3);
        let shapes: Vec<Vec<f32>> = vec![
            (0..5000).map(|_| rng.uniform() * 20.0).collect(),
            (0..5000).map(|_| rng.uniform() * 0.5).collect(),
            (0..5000).map(|i| (i % 7) as f32).collect(),
        ];
        let mut draws = 0;
        for logits in &shapes {
            for (temperature, top_p, min_p) in [(0.7, 0.9, 0.0), (1.3, 0.5, 0.0), (1.0, 0.99, 0.05), (1.0, 1.0, 0.2)] {
                let p = SamplingParams {
                    seed: 11,
                    ..params(temperature, 0, top_p, min_p)
                };
                let mut fast = Sampler::new(p.clone());
                let mut reference = Rng::new(p.seed);
                for _ in 0..200 {
                    let expected = sample_by_full_sort(&p, &mut reference, logits);
                    assert_eq!(fast.sample(logits), expected, "{temperature} {top_p} {min_p}");
                    draws += 1;
                }
            }
        }
        assert_eq!(draws, 2400);
    }

    #[test]
    fn tiny_temperatures_are_greedy() {
        let logits = [0.0, 5.0, 1.0, -3.0];
        for t in [1e-38, 1e-30, 1e-6] {
            let mut s = Sampler::new(params(t, 0, 1.0, 0.0));
            assert!((0..100).all(|_| s.sample(&logits) == 1), "temperature {t}");
            assert_eq!(params(t, 0, 1.0, 0.0).validate().unwrap().temperature, 0.0);
        }
        assert_eq!(params(0.5, 0, 1.0, 0.0).validate().unwrap().temperature, 0.5);
    }

    #[test]
    fn a_tiny_temperature_is_greedy() {
        let logits = [1.0, 4.0, 2.0, 3.0, 0.5];
        for temperature in [1e-38, 1e-40, f32::MIN_POSITIVE, 1e-45] {
            let mut s = Sampler::new(params(temperature, 0, 1.0, 0.0));
            assert_eq!(s.sample(&logits), 1, "temperature {temperature:e}");
            let mut s = Sampler::new(params(temperature, 3, 0.9, 0.1));
            assert_eq!(s.sample(&logits), 1, "temperature {temperature:e} with filters");
        }
    }

    #[test]
    fn a_top_p_of_zero_is_greedy() {
        let p = params(1.0, 0, 0.0, 0.0).validate().unwrap();
        assert!(p.is_greedy());
        let mut rng = Rng::new(7);
        let mut s = Sampler::new(p.clone());
        for _ in 0..200 {
            let logits: Vec<f32> = (0..50).map(|_| 4.0 * rng.uniform()).collect();
            assert_eq!(s.sample(&logits), argmax(&logits));
        }
        // A greedy choice takes no draw from the random stream.
        assert_eq!(s.next_draw(), Sampler::new(p).next_draw());
    }

    #[test]
    fn a_mask_restricts_greedy_and_sampled_draws() {
        // Tokens 1 and 33 allowed (word 0 bit 1, word 1 bit 1); token 2 has the largest logit but is masked out.
        let mut logits = vec![0.0f32; 40];
        logits[2] = 10.0;
        logits[33] = 1.0;
        let mask = [0b10u32, 0b10u32];
        assert_eq!(
            Sampler::new(params(0.0, 0, 1.0, 0.0)).sample_masked(&mut logits.clone(), &mask),
            33
        );
        let mut sampler = Sampler::new(params(1.0, 0, 1.0, 0.0));
        let drawn: std::collections::BTreeSet<u32> = (0..500)
            .map(|_| sampler.sample_masked(&mut logits.clone(), &mask))
            .collect();
        assert_eq!(drawn, [1, 33].into());
        // A mask shorter than the logits refuses the tokens past its end.
        let mut short = logits.clone();
        apply_token_mask(&mut short, &[0b10]);
        assert!(short[33] == f32::NEG_INFINITY && short[1] == 0.0);
    }

    /// A draw taken by a device (`next_draw`) moves the host's stream on as one `sample` does: the draw after it
    /// is the same either way.
    #[test]
    fn next_draw_keeps_the_stream_in_step() {
        let logits: Vec<f32> = (0..50).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let p = params(1.0, 0, 1.0, 0.0);
        let (mut sampled, mut skipped) = (Sampler::new(p.clone()), Sampler::new(p));
        for draw in 1..=20u64 {
            sampled.sample(&logits);
            assert_eq!(skipped.next_draw(), draw);
        }
        let after: Vec<u32> = (0..20).map(|_| sampled.sample(&logits)).collect();
        let after_skip: Vec<u32> = (0..20).map(|_| skipped.sample(&logits)).collect();
        assert_eq!(after, after_skip);
    }

    #[test]
    fn bad_parameters_are_refused() {
        assert_eq!(params(-1.0, 0, 1.0, 0.0).validate().unwrap_err().param(), "temperature");
        assert!(params(f32::NAN, 0, 1.0, 0.0).validate().is_err());
        assert!(params(1.0, 0, -0.1, 0.0).validate().is_err());
        assert!(params(1.0, 0, 1.01, 0.0).validate().is_err());
        assert!(params(1.0, 0, 1.0, 1.5).validate().is_err());
        assert!(params(0.7, 20, 0.95, 0.05).validate().is_ok());
    }
}
