//! The seam between the engine (server, CLI) and a compute backend: one sequence at a time, prefill then decode
//! steps, with the next-token choice left to the backend so a GPU can sample without copying logits out.

use crate::config::Config;
use crate::cpu::model::PREFILL_SLICE;
use crate::cpu::{CpuModel, State};
use crate::sampling::{Sampler, SamplingParams};

/// Why a backend could not run a prefill or decode step, or give its logits or next token.
#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    #[error("context full: {needed} tokens needed but the context holds {max_context}")]
    ContextFull { needed: usize, max_context: usize },
    #[error("token id {0} is outside the vocabulary")]
    BadToken(u32),
    #[error("empty prompt")]
    EmptyPrompt,
    /// A compute device failed (a GPU backend's driver error).
    #[error("device: {0}")]
    Device(String),
}

pub trait Backend: Send {
    fn config(&self) -> &Config;
    /// Tokens of context (prompt plus generated) a sequence may hold.
    fn max_context(&self) -> usize;
    /// Starts a new sequence with `prompt` (non-empty) and computes the next-token logits.
    fn prefill(&mut self, prompt: &[u32]) -> Result<(), ForwardError>;
    /// As [`Backend::prefill`], but asks `cancelled` between slices of the prompt and stops when it answers true:
    /// `Ok(false)`, and the sequence is unusable until the next prefill. A backend that cannot split a prefill
    /// runs it whole, as this default does.
    fn prefill_cancellable(&mut self, prompt: &[u32], cancelled: &dyn Fn() -> bool) -> Result<bool, ForwardError> {
        let _ = cancelled;
        self.prefill(prompt).map(|()| true)
    }
    /// Appends `token` to the sequence and computes the next-token logits.
    fn decode(&mut self, token: u32) -> Result<(), ForwardError>;
    /// Continues the sequence with `tokens` (non-empty), a prefill after the context so far, and computes the
    /// next-token logits. This default decodes them one at a time; a backend with a continuing prefill uses it.
    fn extend(&mut self, tokens: &[u32]) -> Result<(), ForwardError> {
        if tokens.is_empty() {
            return Err(ForwardError::EmptyPrompt);
        }
        tokens.iter().try_for_each(|&token| self.decode(token))
    }
    /// The next-token logits after the last `prefill` or `decode` (may copy them from a device, which may fail).
    fn logits(&mut self) -> Result<&[f32], ForwardError>;
    /// Chooses the next token exactly as `sampler` would from `logits()` on the host. A backend samples where the
    /// logits are when it can (see `samples_on_device`) and copies them out otherwise. Sampling only knows
    /// `SamplingParams`: whatever else a request asks for (penalties, logit bias, logprobs) is done by the caller on
    /// `logits()`.
    fn sample(&mut self, sampler: &mut Sampler) -> Result<u32, ForwardError> {
        Ok(sampler.sample(self.logits()?))
    }
    /// As [`Backend::sample`], among the tokens `allowed` lets through (bit `t % 32` of word `t / 32` set: token `t`
    /// allowed; at least one is), exactly as `sampler.sample_masked` would on a copy of `logits()`. A GPU backend
    /// sends the mask to the device instead of copying the logits out where it can; this default copies them.
    fn sample_masked(&mut self, sampler: &mut Sampler, allowed: &[u32]) -> Result<u32, ForwardError> {
        let mut logits = self.logits()?.to_vec();
        Ok(sampler.sample_masked(&mut logits, allowed))
    }
    /// Starts a new sequence with `prompt` as `prefill` does, and hands `each(i, logits)` the next-token logits
    /// after every prompt position `i` (for the prompt's logprobs); `each` returning false stops early, leaving the
    /// sequence part-way. The prompt goes through one `decode` step per token, so that every position's logits
    /// come out of the same forward pass that generation uses.
    fn prefill_each(
        &mut self,
        prompt: &[u32],
        each: &mut dyn FnMut(usize, &[f32]) -> bool,
    ) -> Result<(), ForwardError> {
        let Some(&first) = prompt.first() else {
            return self.prefill(prompt);
        };
        self.prefill(&[first])?;
        if !each(0, self.logits()?) {
            return Ok(());
        }
        for (i, &token) in prompt.iter().enumerate().skip(1) {
            self.decode(token)?;
            if !each(i, self.logits()?) {
                return Ok(());
            }
        }
        Ok(())
    }
    /// Whether `sample` draws from `params` where the logits are, without copying them to the host (a CPU backend
    /// always does).
    fn samples_on_device(&self, params: &SamplingParams) -> bool {
        let _ = params;
        true
    }
    /// Waits until the work queued so far has finished (a GPU runs asynchronously), so that timings are honest.
    fn synchronize(&mut self) -> Result<(), ForwardError> {
        Ok(())
    }
    /// A short name for logs ("cpu", "cuda: NVIDIA H200").
    fn describe(&self) -> String;
}

/// A sequence's place in a [`BatchBackend`]: an index below `max_seqs()`.
pub type Slot = usize;

/// One row of a batched decode step: `token` goes at the next position of the sequence in `slot`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepRow {
    pub slot: Slot,
    pub token: u32,
}

/// One sequence's part of a [`BatchBackend::prefill_parts`] call: `tokens` go at the next positions of the sequence
/// in `slot`, and the sequence is snapshotted as it stands after the first `cut` of them for each of `cuts`
/// (ascending, each in 1 .. tokens.len(); see `BatchBackend::prefill_snapshot`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefillPart<'a> {
    pub slot: Slot,
    pub tokens: &'a [u32],
    pub cuts: &'a [usize],
}

/// How the next token of one output row is chosen: as `sampler` would from that row's logits, among the tokens
/// `allowed` lets through when given (bit `t % 32` of word `t / 32` set: token `t` allowed; at least one is).
pub struct Pick<'a> {
    /// Output row of the last call: 0 after `prefill`, the part's index after `prefill_parts`, the row's index in
    /// `rows` after `step`.
    pub row: usize,
    pub sampler: &'a mut Sampler,
    pub allowed: Option<&'a [u32]>,
}

impl Pick<'_> {
    /// The pick's token drawn on the host from its row's `logits`; a mask is applied to a copy in `row_copy`.
    pub fn sample_on_host(&mut self, logits: &[f32], row_copy: &mut Vec<f32>) -> u32 {
        match self.allowed {
            Some(allowed) => {
                row_copy.clear();
                row_copy.extend_from_slice(logits);
                self.sampler.sample_masked(row_copy, allowed)
            }
            None => self.sampler.sample(logits),
        }
    }
}

/// The seam between the batching engine and a compute backend: many sequences resident at once, each in its own
/// slot, advanced together one token per `step`, with prompts entering in chunks through `prefill`.
///
/// Memory: every slot has its fixed recurrent state; the context (the attention layers' keys and values) comes
/// from one pool shared by all slots, granted by `reserve`. The engine grants a sequence its prompt and some tokens
/// ahead when it starts and more as it decodes; when the pool runs out, it releases the slots of the sequences it
/// admitted last and computes them again later.
pub trait BatchBackend: Send {
    fn config(&self) -> &Config;
    /// Tokens of context (prompt plus generated) one sequence may hold.
    fn max_context(&self) -> usize;
    /// Slots: the most sequences resident at once.
    fn max_seqs(&self) -> usize;
    /// Rows one `step` takes at most.
    fn max_step_rows(&self) -> usize;
    /// Tokens one `prefill` call takes at most.
    fn max_prefill_tokens(&self) -> usize;
    /// Context, in tokens, that `reserve` can still grant from the pool.
    fn free_tokens(&self) -> usize;
    /// Makes `slot` able to hold `tokens` positions, taking context memory from the pool (rounded up to the pool's
    /// unit). `Ok(false)`, with nothing changed, when the pool lacks it; a slot already holding enough is unchanged.
    fn reserve(&mut self, slot: Slot, tokens: usize) -> Result<bool, ForwardError>;
    /// Empties `slot`: its length is 0 and its context memory returns to the pool.
    fn release(&mut self, slot: Slot);
    /// Tokens in the sequence held by `slot`.
    fn len(&self, slot: Slot) -> usize;
    /// Appends `tokens` (1 ..= `max_prefill_tokens`) to the sequence in `slot` (an empty slot starts afresh) and
    /// computes the last token's next-token logits as output row 0. The slot's reservation must cover the result.
    fn prefill(&mut self, slot: Slot, tokens: &[u32]) -> Result<(), ForwardError>;
    /// Prompt tokens an engine iteration prefills when its user names no budget: more make short prompts arriving
    /// together share longer passes, fewer keep a long prompt's chunks from holding the running sequences' next
    /// tokens back. This default (2048) suits a backend that prefills a few thousand tokens a second at most.
    fn prefill_budget(&self) -> usize {
        2048
    }
    /// Sequences one `prefill_parts` call takes at most. This default (1) has the engine call `prefill` alone.
    fn max_prefill_parts(&self) -> usize {
        1
    }
    /// Prefills several sequences in one call, as `prefill_snapshot` would each: part `i` appends its tokens to the
    /// sequence in its slot (the parts name distinct slots, 1 ..= `max_prefill_parts` of them, `max_prefill_tokens`
    /// tokens in all) and snapshots it at its cuts, and its last token's next-token logits are output row `i`.
    /// Returns each part's snapshots, `None` where the backend had no room. One pass over the parts' tokens
    /// together reads every weight once for all of them, where a call each would read them once a part. This
    /// default takes a single part.
    fn prefill_parts(&mut self, parts: &[PrefillPart<'_>]) -> Result<Vec<Vec<Option<SnapshotId>>>, ForwardError> {
        match parts {
            [part] => Ok(vec![self.prefill_snapshot(part.slot, part.tokens, part.cuts)?]),
            _ => Err(ForwardError::Device(format!(
                "this backend prefills one sequence a call, not {}",
                parts.len()
            ))),
        }
    }
    /// Makes `to` (empty, reserved for at least `len(from)` tokens) a copy of the sequence in `from`, so that the
    /// choices of one request share one prefill.
    fn fork(&mut self, from: Slot, to: Slot) -> Result<(), ForwardError>;
    /// Appends each row's token to its slot's sequence (rows name distinct slots, 1 ..= `max_step_rows` of them)
    /// and computes the next-token logits of each, output row `i` for `rows[i]`.
    fn step(&mut self, rows: &[StepRow]) -> Result<(), ForwardError>;
    /// Whether `step` only queues the step on a device and returns before it has run (a GPU's stream). The engine
    /// then queues the next step before it handles the tokens of the last one, so that the host's work overlaps
    /// the device's; such a backend takes `snapshot`, `release` and `len` calls while a step is queued, ordering
    /// their effects after it. This default (a step computed in the call) says no.
    fn queues_steps(&self) -> bool {
        false
    }
    /// The next-token logits of output `row` of the last `prefill` or `step` (may copy them from a device).
    fn logits(&mut self, row: usize) -> Result<&[f32], ForwardError>;
    /// The next token of each pick, in order. A backend samples where the logits are when it can and copies the
    /// row out otherwise; this default samples every row on the host.
    fn sample(&mut self, picks: &mut [Pick<'_>]) -> Result<Vec<u32>, ForwardError> {
        let mut tokens = Vec::with_capacity(picks.len());
        let mut row_copy = Vec::new();
        for pick in picks.iter_mut() {
            let logits = self.logits(pick.row)?;
            tokens.push(pick.sample_on_host(logits, &mut row_copy));
        }
        Ok(tokens)
    }
    /// Waits until the work queued so far has finished (a GPU runs asynchronously), so that timings are honest.
    fn synchronize(&mut self) -> Result<(), ForwardError> {
        Ok(())
    }
    /// A short name for logs ("cpu", "cuda: NVIDIA H200").
    fn describe(&self) -> String;

    /// Saves the state of the sequence in `slot` (all `len(slot)` tokens of it: the recurrent state as it is now
    /// and the context of every position) as a snapshot that `restore` can start other sequences from; the
    /// sequence in `slot` goes on unchanged. `Ok(None)` when the backend has no room for another snapshot (the
    /// caller may drop one and try again) or keeps none, as this default.
    fn snapshot(&mut self, slot: Slot) -> Result<Option<SnapshotId>, ForwardError> {
        let _ = slot;
        Ok(None)
    }
    /// Whether [`BatchBackend::prefill_snapshot`] takes its snapshots inside one prefill pass. This default
    /// (snapshots only between calls) says no, so a caller stops its prefill at each point instead.
    fn snapshots_in_prefill(&self) -> bool {
        false
    }
    /// How many more snapshots fit now, for a backend with a fixed number of snapshot buffers (its free ones). This
    /// default says there is no fixed number, leaving the answer to `snapshot`.
    fn snapshot_room(&self) -> usize {
        usize::MAX
    }
    /// Appends `tokens` to the sequence in `slot` as `prefill` does, and snapshots the sequence as it stands after
    /// the first `cut` of them for each of `cuts` (ascending, each in 1 .. tokens.len()), as `snapshot` between
    /// `prefill` calls would. Returns a snapshot per cut, `None` where the backend had no room for it (the prefill
    /// is done either way). This default makes those calls; a backend that can cut its pass does it in one (see
    /// `snapshots_in_prefill`).
    fn prefill_snapshot(
        &mut self,
        slot: Slot,
        tokens: &[u32],
        cuts: &[usize],
    ) -> Result<Vec<Option<SnapshotId>>, ForwardError> {
        check_cuts(tokens.len(), cuts)?;
        let mut ids = Vec::with_capacity(cuts.len());
        let mut done = 0;
        for &cut in cuts {
            self.prefill(slot, &tokens[done..cut])?;
            ids.push(self.snapshot(slot)?);
            done = cut;
        }
        self.prefill(slot, &tokens[done..])?;
        Ok(ids)
    }
    /// Starts the empty `slot` as a copy of snapshot `id` (its `len(slot)` is the snapshot's length) and reserves
    /// `tokens` positions for it, as `reserve` would. `Ok(false)`, with the slot still empty, when the pool lacks
    /// the memory. Context that the snapshot and the slot share is shared, not copied, where the backend can.
    fn restore(&mut self, id: SnapshotId, slot: Slot, tokens: usize) -> Result<bool, ForwardError> {
        let _ = (slot, tokens);
        Err(ForwardError::Device(format!(
            "no snapshot {id}: this backend keeps none"
        )))
    }
    /// Frees snapshot `id`: its recurrent state, and the context no sequence or other snapshot shares.
    fn drop_snapshot(&mut self, id: SnapshotId) {
        let _ = id;
    }
    /// Memory, in bytes, that the snapshots hold now and that no running sequence shares (what dropping every
    /// snapshot would free).
    fn snapshot_bytes(&self) -> usize {
        0
    }
    /// Context, in tokens of the pool, that dropping every snapshot would return to it (what snapshots hold of the
    /// pool that no running sequence shares).
    fn snapshot_tokens(&self) -> usize {
        0
    }
}

/// Checks that `cuts` are ascending positions inside a prefill of `tokens` tokens (see
/// `BatchBackend::prefill_snapshot`).
pub fn check_cuts(tokens: usize, cuts: &[usize]) -> Result<(), ForwardError> {
    let inside = cuts.iter().all(|&c| c >= 1 && c < tokens);
    if !inside || cuts.windows(2).any(|w| w[0] >= w[1]) {
        return Err(ForwardError::Device(format!(
            "snapshots inside a prefill of {tokens} tokens cannot be after {cuts:?}"
        )));
    }
    Ok(())
}

/// Checks a [`BatchBackend::prefill_parts`] call's shape: 1 ..= `max_parts` parts of at least one token each with
/// their cuts inside them, in distinct slots, `max_tokens` tokens in all at most.
pub fn check_parts(parts: &[PrefillPart<'_>], max_parts: usize, max_tokens: usize) -> Result<(), ForwardError> {
    if parts.is_empty() || parts.len() > max_parts {
        return Err(ForwardError::Device(format!(
            "a prefill call takes 1 ..= {max_parts} sequences, not {}",
            parts.len()
        )));
    }
    if parts.iter().any(|p| p.tokens.is_empty()) {
        return Err(ForwardError::EmptyPrompt);
    }
    for p in parts {
        check_cuts(p.tokens.len(), p.cuts)?;
    }
    let tokens: usize = parts.iter().map(|p| p.tokens.len()).sum();
    if tokens > max_tokens {
        return Err(ForwardError::Device(format!(
            "a prefill call takes at most {max_tokens} tokens, not {tokens}"
        )));
    }
    for (i, part) in parts.iter().enumerate() {
        if parts[..i].iter().any(|p| p.slot == part.slot) {
            return Err(ForwardError::Device(format!(
                "slot {} appears twice in one prefill call",
                part.slot
            )));
        }
    }
    Ok(())
}

/// A snapshot of one sequence's state held by a [`BatchBackend`] (see `BatchBackend::snapshot`).
pub type SnapshotId = usize;

/// The CPU backend with its preallocated state.
pub struct CpuBackend {
    model: CpuModel,
    state: State,
    logits: Vec<f32>,
}

impl CpuBackend {
    pub fn new(model: CpuModel, max_context: usize) -> CpuBackend {
        let state = model.new_state(max_context);
        let logits = vec![0.0; model.config().vocab_size];
        CpuBackend { model, state, logits }
    }

    pub fn model(&self) -> &CpuModel {
        &self.model
    }

    /// The smallest routing margin of the last prefill or decode step (see `State::route_margin`).
    pub fn route_margin(&self) -> f32 {
        self.state.route_margin
    }
}

impl Backend for CpuBackend {
    fn config(&self) -> &Config {
        self.model.config()
    }
    fn max_context(&self) -> usize {
        self.state.max_context
    }
    fn prefill(&mut self, prompt: &[u32]) -> Result<(), ForwardError> {
        self.state.reset();
        self.model.prefill(&mut self.state, prompt, &mut self.logits)
    }
    /// Runs the prompt one [`PREFILL_SLICE`] at a time, each slice continuing the sequence.
    fn prefill_cancellable(&mut self, prompt: &[u32], cancelled: &dyn Fn() -> bool) -> Result<bool, ForwardError> {
        if prompt.is_empty() {
            return Err(ForwardError::EmptyPrompt);
        }
        self.state.reset();
        for slice in prompt.chunks(PREFILL_SLICE) {
            if cancelled() {
                return Ok(false);
            }
            self.model.prefill(&mut self.state, slice, &mut self.logits)?;
        }
        Ok(true)
    }
    fn decode(&mut self, token: u32) -> Result<(), ForwardError> {
        self.model.decode(&mut self.state, token, &mut self.logits)
    }
    fn extend(&mut self, tokens: &[u32]) -> Result<(), ForwardError> {
        self.model.prefill(&mut self.state, tokens, &mut self.logits)
    }
    fn logits(&mut self) -> Result<&[f32], ForwardError> {
        Ok(&self.logits)
    }
    fn describe(&self) -> String {
        format!("cpu ({} threads)", rayon::current_num_threads())
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;
    use crate::config::Config;

    fn tiny_backend() -> CpuBackend {
        let mut config = Config::tiny_shape();
        config.quantization = Config::from_json(&config.to_mlx_json()).unwrap().quantization;
        let checkpoint = crate::synth::checkpoint_in_memory(&config, 7).unwrap();
        let weights = crate::Weights::from_checkpoint(config, &checkpoint).unwrap();
        CpuBackend::new(CpuModel::new(weights), 4 * PREFILL_SLICE)
    }

    /// The default `sample_masked` draws among the allowed tokens only: greedy takes the best allowed logit, and
    /// a sampled draw never leaves the mask.
    #[test]
    fn sample_masked_keeps_to_the_mask() {
        let mut backend = tiny_backend();
        backend.prefill(&[1, 2, 3]).unwrap();
        let logits = backend.logits().unwrap().to_vec();
        let best = crate::sampling::argmax(&logits) as usize;
        // Every third token, the unmasked best excluded.
        let allowed_token = |t: usize| t.is_multiple_of(3) && t != best;
        let mut mask = vec![0u32; logits.len().div_ceil(32)];
        (0..logits.len())
            .filter(|&t| allowed_token(t))
            .for_each(|t| mask[t / 32] |= 1 << (t % 32));
        let best_allowed = (0..logits.len())
            .filter(|&t| allowed_token(t))
            .fold(None, |b: Option<usize>, t| match b {
                Some(b) if logits[b] >= logits[t] => Some(b),
                _ => Some(t),
            })
            .unwrap();
        let mut greedy = Sampler::new(SamplingParams::default());
        assert_eq!(
            backend.sample_masked(&mut greedy, &mask).unwrap() as usize,
            best_allowed
        );
        let mut sampled = Sampler::new(SamplingParams {
            temperature: 1.5,
            seed: 5,
            ..Default::default()
        });
        for _ in 0..200 {
            let token = backend.sample_masked(&mut sampled, &mask).unwrap() as usize;
            assert!(allowed_token(token), "token {token} is masked out");
        }
    }

    #[test]
    fn a_prefill_in_slices_matches_one_prefill_and_stops_when_cancelled() {
        let mut backend = tiny_backend();
        let vocab = backend.config().vocab_size as u32;
        let prompt: Vec<u32> = (0..2 * PREFILL_SLICE as u32 + 17).map(|i| (i * 7919) % vocab).collect();
        backend.prefill(&prompt).unwrap();
        let whole = backend.logits().unwrap().to_vec();
        let asked = Cell::new(0);
        let done = backend
            .prefill_cancellable(&prompt, &|| {
                asked.set(asked.get() + 1);
                false
            })
            .unwrap();
        assert!(done);
        assert_eq!(asked.get(), 3, "asked before each of the three slices");
        let sliced = backend.logits().unwrap().to_vec();
        let worst = whole
            .iter()
            .zip(&sliced)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(worst < 1e-4, "sliced prefill differs by {worst}");
        // Cancelled after the first slice: stops there.
        let asked = Cell::new(0);
        let done = backend
            .prefill_cancellable(&prompt, &|| {
                asked.set(asked.get() + 1);
                asked.get() > 1
            })
            .unwrap();
        assert!(!done);
        assert_eq!(asked.get(), 2);
        assert_eq!(backend.state.position, PREFILL_SLICE);
    }
}
