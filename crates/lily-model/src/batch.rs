//! [`BatchBackend`]s built on the single-sequence pieces: [`CpuBatchBackend`] keeps one CPU [`State`] per slot and
//! runs a step's rows in one batched decode step; [`SingleSlot`] serves any [`Backend`] as a batch backend of one
//! slot.

use std::collections::HashMap;

use crate::backend::{check_parts, Backend, BatchBackend, ForwardError, Pick, PrefillPart, Slot, SnapshotId, StepRow};
use crate::config::Config;
use crate::cpu::model::{SavedState, PREFILL_SLICE};
use crate::cpu::{CpuModel, DecodeRow, State};

/// The unit in which the CPU batch backend grants context: a slot's reservation is a multiple of it, as a GPU pool
/// grants whole pages.
pub const CPU_POOL_UNIT: usize = 64;

/// The CPU model serving several sequences: each slot has its own [`State`], created when the slot is first
/// reserved and dropped when it is released, with a KV cache as long as its reservation. The pool is a budget of
/// context tokens shared by the slots; a step runs its rows together through `CpuModel::decode_rows`, each row's
/// logits kept for sampling.
///
/// Snapshots (for the prefix cache) are copies of a slot's state, held in host memory up to a budget of bytes set
/// by [`CpuBatchBackend::with_snapshot_budget`] (none by default); they do not count against the pool.
pub struct CpuBatchBackend {
    model: CpuModel,
    max_context: usize,
    pool_tokens: usize,
    slots: Vec<CpuSlot>,
    snapshots: HashMap<SnapshotId, SavedState>,
    next_snapshot: SnapshotId,
    snapshot_budget: usize,
    snapshot_used: usize,
    /// Output rows of the last `prefill` (row 0) or `step`, `[rows][vocab]`.
    logits: Vec<f32>,
    rows: usize,
}

/// The state of `slot`, checked to have room for `tokens` more positions within its reservation.
fn state_for(slots: &mut [CpuSlot], max_context: usize, slot: Slot, tokens: usize) -> Result<&mut State, ForwardError> {
    let count = slots.len();
    let entry = slots
        .get_mut(slot)
        .ok_or_else(|| ForwardError::Device(format!("slot {slot} is outside the {count} slots")))?;
    let room = entry.reserved.min(max_context);
    let state = entry.state.as_mut().ok_or(ForwardError::ContextFull {
        needed: tokens,
        max_context: 0,
    })?;
    let needed = state.position + tokens;
    if needed > room {
        return Err(ForwardError::ContextFull {
            needed,
            max_context: room,
        });
    }
    Ok(state)
}

#[derive(Default)]
struct CpuSlot {
    state: Option<State>,
    /// Context tokens granted from the pool (a multiple of `CPU_POOL_UNIT`).
    reserved: usize,
}

impl CpuBatchBackend {
    /// `max_seqs` slots sharing `pool_tokens` tokens of context, at most `max_context` per sequence (capped by the
    /// pool, since a sequence cannot hold more than the pool grants). The pool is rounded down to whole units.
    pub fn new(model: CpuModel, max_context: usize, max_seqs: usize, pool_tokens: usize) -> CpuBatchBackend {
        let pool_tokens = pool_tokens / CPU_POOL_UNIT * CPU_POOL_UNIT;
        let max_seqs = max_seqs.max(1);
        CpuBatchBackend {
            max_context: max_context.min(pool_tokens),
            pool_tokens,
            slots: (0..max_seqs).map(|_| CpuSlot::default()).collect(),
            snapshots: HashMap::new(),
            next_snapshot: 0,
            snapshot_budget: 0,
            snapshot_used: 0,
            logits: Vec::new(),
            rows: 0,
            model,
        }
    }

    /// Lets snapshots hold up to `bytes` of host memory in all.
    pub fn with_snapshot_budget(mut self, bytes: usize) -> CpuBatchBackend {
        self.snapshot_budget = bytes;
        self
    }

    pub fn model(&self) -> &CpuModel {
        &self.model
    }

    /// Context tokens the pool holds in all.
    pub fn pool_tokens(&self) -> usize {
        self.pool_tokens
    }

    fn reserved(&self) -> usize {
        self.slots.iter().map(|s| s.reserved).sum()
    }

    fn slot(&mut self, slot: Slot) -> Result<&mut CpuSlot, ForwardError> {
        let count = self.slots.len();
        self.slots
            .get_mut(slot)
            .ok_or_else(|| ForwardError::Device(format!("slot {slot} is outside the {count} slots")))
    }

    fn output_rows(&mut self, rows: usize) {
        let vocab = self.model.config().vocab_size;
        if self.logits.len() < rows * vocab {
            self.logits.resize(rows * vocab, 0.0);
        }
        self.rows = rows;
    }
}

impl BatchBackend for CpuBatchBackend {
    fn config(&self) -> &Config {
        self.model.config()
    }
    fn max_context(&self) -> usize {
        self.max_context
    }
    fn max_seqs(&self) -> usize {
        self.slots.len()
    }
    fn max_step_rows(&self) -> usize {
        self.slots.len()
    }
    fn max_prefill_tokens(&self) -> usize {
        // Any length works; the model runs it in slices of PREFILL_SLICE tokens itself.
        self.max_context.max(PREFILL_SLICE)
    }
    fn free_tokens(&self) -> usize {
        self.pool_tokens - self.reserved()
    }
    fn reserve(&mut self, slot: Slot, tokens: usize) -> Result<bool, ForwardError> {
        if tokens > self.max_context {
            return Err(ForwardError::ContextFull {
                needed: tokens,
                max_context: self.max_context,
            });
        }
        let want = tokens.div_ceil(CPU_POOL_UNIT) * CPU_POOL_UNIT;
        let free = self.free_tokens();
        let config = self.model.config().clone();
        let entry = self.slot(slot)?;
        if want <= entry.reserved {
            return Ok(true);
        }
        if want - entry.reserved > free {
            return Ok(false);
        }
        entry.reserved = want;
        match entry.state.as_mut() {
            Some(state) => state.set_max_context(want),
            None => entry.state = Some(State::new(&config, want)),
        }
        Ok(true)
    }
    fn release(&mut self, slot: Slot) {
        if let Some(entry) = self.slots.get_mut(slot) {
            *entry = CpuSlot::default();
        }
    }
    fn len(&self, slot: Slot) -> usize {
        self.slots
            .get(slot)
            .and_then(|s| s.state.as_ref())
            .map_or(0, |s| s.position)
    }
    fn prefill(&mut self, slot: Slot, tokens: &[u32]) -> Result<(), ForwardError> {
        if tokens.is_empty() {
            return Err(ForwardError::EmptyPrompt);
        }
        self.output_rows(1);
        let vocab = self.model.config().vocab_size;
        let mut logits = std::mem::take(&mut self.logits);
        let result = state_for(&mut self.slots, self.max_context, slot, tokens.len())
            .and_then(|state| self.model.prefill(state, tokens, &mut logits[..vocab]));
        self.logits = logits;
        result
    }
    fn max_prefill_parts(&self) -> usize {
        self.slots.len()
    }
    /// The parts one after another (the CPU gains nothing from one pass over them), each into its own output row
    /// and snapshotted between the pieces of its cuts; every part is checked before the first is run, so a bad one
    /// changes nothing.
    fn prefill_parts(&mut self, parts: &[PrefillPart<'_>]) -> Result<Vec<Vec<Option<SnapshotId>>>, ForwardError> {
        check_parts(parts, self.max_prefill_parts(), self.max_prefill_tokens())?;
        for part in parts {
            state_for(&mut self.slots, self.max_context, part.slot, part.tokens.len())?;
        }
        self.output_rows(parts.len());
        let vocab = self.model.config().vocab_size;
        let mut logits = std::mem::take(&mut self.logits);
        let mut run = || -> Result<Vec<Vec<Option<SnapshotId>>>, ForwardError> {
            let mut ids = Vec::with_capacity(parts.len());
            for (i, part) in parts.iter().enumerate() {
                let row = &mut logits[i * vocab..(i + 1) * vocab];
                let mut part_ids = Vec::with_capacity(part.cuts.len());
                let mut done = 0;
                for &end in part.cuts.iter().chain([&part.tokens.len()]) {
                    let state = state_for(&mut self.slots, self.max_context, part.slot, end - done)?;
                    self.model.prefill(state, &part.tokens[done..end], row)?;
                    if end < part.tokens.len() {
                        part_ids.push(self.snapshot(part.slot)?);
                    }
                    done = end;
                }
                ids.push(part_ids);
            }
            Ok(ids)
        };
        let result = run();
        self.logits = logits;
        result
    }
    fn fork(&mut self, from: Slot, to: Slot) -> Result<(), ForwardError> {
        let source = self
            .slot(from)?
            .state
            .clone()
            .ok_or_else(|| ForwardError::Device(format!("fork from the empty slot {from}")))?;
        let target = self.slot(to)?;
        if target.reserved < source.position {
            return Err(ForwardError::ContextFull {
                needed: source.position,
                max_context: target.reserved,
            });
        }
        let mut state = source;
        state.set_max_context(target.reserved);
        target.state = Some(state);
        Ok(())
    }
    /// Every row in one decode step of the model ([`CpuModel::decode_rows`]), which reads each matrix once for all
    /// of them. Every row is checked before any runs, so a bad one changes nothing.
    fn step(&mut self, rows: &[StepRow]) -> Result<(), ForwardError> {
        if rows.is_empty() || rows.len() > self.slots.len() {
            return Err(ForwardError::Device(format!(
                "a step takes 1 to {} rows, not {}",
                self.slots.len(),
                rows.len()
            )));
        }
        let mut taken = vec![false; self.slots.len()];
        for row in rows {
            state_for(&mut self.slots, self.max_context, row.slot, 1)?;
            if std::mem::replace(&mut taken[row.slot], true) {
                return Err(ForwardError::Device(format!(
                    "slot {} has two rows in one step",
                    row.slot
                )));
            }
        }
        self.output_rows(rows.len());
        let vocab = self.model.config().vocab_size;
        let mut logits = std::mem::take(&mut self.logits);
        let mut states: Vec<Option<&mut State>> = self.slots.iter_mut().map(|s| s.state.as_mut()).collect();
        let mut decode: Vec<DecodeRow> = rows
            .iter()
            .zip(logits.chunks_exact_mut(vocab))
            .map(|(row, out)| DecodeRow {
                state: states[row.slot]
                    .take()
                    .expect("each row's slot was checked to hold a state"),
                token: row.token,
                logits: out,
            })
            .collect();
        let result = self.model.decode_rows(&mut decode);
        drop(decode);
        self.logits = logits;
        result
    }
    fn logits(&mut self, row: usize) -> Result<&[f32], ForwardError> {
        if row >= self.rows {
            return Err(ForwardError::Device(format!(
                "output row {row} of a call with {} rows",
                self.rows
            )));
        }
        let vocab = self.model.config().vocab_size;
        Ok(&self.logits[row * vocab..(row + 1) * vocab])
    }
    fn describe(&self) -> String {
        format!("cpu ({} threads)", rayon::current_num_threads())
    }
    fn snapshot(&mut self, slot: Slot) -> Result<Option<SnapshotId>, ForwardError> {
        let saved = match self.slot(slot)?.state.as_ref() {
            Some(state) if state.position > 0 => state.save(),
            _ => return Err(ForwardError::Device(format!("snapshot of the empty slot {slot}"))),
        };
        if self.snapshot_used + saved.bytes() > self.snapshot_budget {
            return Ok(None);
        }
        let id = self.next_snapshot;
        self.next_snapshot += 1;
        self.snapshot_used += saved.bytes();
        self.snapshots.insert(id, saved);
        Ok(Some(id))
    }
    fn restore(&mut self, id: SnapshotId, slot: Slot, tokens: usize) -> Result<bool, ForwardError> {
        let position = self
            .snapshots
            .get(&id)
            .ok_or_else(|| ForwardError::Device(format!("no snapshot {id}")))?
            .position;
        if self.len(slot) != 0 {
            return Err(ForwardError::Device(format!(
                "restore into slot {slot}, which is not empty"
            )));
        }
        if !self.reserve(slot, tokens.max(position))? {
            return Ok(false);
        }
        let saved = &self.snapshots[&id];
        let state = self.slots[slot].state.as_mut().expect("reserved above");
        state.load(saved);
        Ok(true)
    }
    fn drop_snapshot(&mut self, id: SnapshotId) {
        if let Some(saved) = self.snapshots.remove(&id) {
            self.snapshot_used -= saved.bytes();
        }
    }
    fn snapshot_bytes(&self) -> usize {
        self.snapshot_used
    }
}

/// Any single-sequence [`Backend`] as a [`BatchBackend`] of one slot, its context the whole pool: a step is one
/// `decode`, a prefill continuing the slot is `Backend::extend`, and a pick is the backend's own `sample` or, with
/// a mask, `sample_masked` (on a GPU, where the logits are).
pub struct SingleSlot {
    backend: Box<dyn Backend>,
    reserved: usize,
    len: usize,
}

impl SingleSlot {
    pub fn new(backend: Box<dyn Backend>) -> SingleSlot {
        SingleSlot {
            backend,
            reserved: 0,
            len: 0,
        }
    }

    fn check_slot(slot: Slot) -> Result<(), ForwardError> {
        match slot {
            0 => Ok(()),
            _ => Err(ForwardError::Device(format!("slot {slot} of a backend with one slot"))),
        }
    }
}

impl BatchBackend for SingleSlot {
    fn config(&self) -> &Config {
        self.backend.config()
    }
    fn max_context(&self) -> usize {
        self.backend.max_context()
    }
    fn max_seqs(&self) -> usize {
        1
    }
    fn max_step_rows(&self) -> usize {
        1
    }
    fn max_prefill_tokens(&self) -> usize {
        self.backend.max_context()
    }
    fn free_tokens(&self) -> usize {
        self.backend.max_context() - self.reserved
    }
    fn reserve(&mut self, slot: Slot, tokens: usize) -> Result<bool, ForwardError> {
        Self::check_slot(slot)?;
        if tokens > self.backend.max_context() {
            return Ok(false);
        }
        self.reserved = self.reserved.max(tokens);
        Ok(true)
    }
    fn release(&mut self, slot: Slot) {
        if slot == 0 {
            self.reserved = 0;
            self.len = 0;
        }
    }
    fn len(&self, slot: Slot) -> usize {
        if slot == 0 {
            self.len
        } else {
            0
        }
    }
    fn prefill(&mut self, slot: Slot, tokens: &[u32]) -> Result<(), ForwardError> {
        Self::check_slot(slot)?;
        if tokens.is_empty() {
            return Err(ForwardError::EmptyPrompt);
        }
        let needed = self.len + tokens.len();
        if needed > self.reserved {
            return Err(ForwardError::ContextFull {
                needed,
                max_context: self.reserved,
            });
        }
        if self.len == 0 {
            self.backend.prefill(tokens)?;
        } else {
            self.backend.extend(tokens)?;
        }
        self.len = needed;
        Ok(())
    }
    fn fork(&mut self, from: Slot, to: Slot) -> Result<(), ForwardError> {
        Err(ForwardError::Device(format!(
            "a backend with one slot cannot fork slot {from} into {to}"
        )))
    }
    fn step(&mut self, rows: &[StepRow]) -> Result<(), ForwardError> {
        let [row] = rows else {
            return Err(ForwardError::Device(format!("a step takes 1 row, not {}", rows.len())));
        };
        Self::check_slot(row.slot)?;
        if self.len + 1 > self.reserved {
            return Err(ForwardError::ContextFull {
                needed: self.len + 1,
                max_context: self.reserved,
            });
        }
        self.backend.decode(row.token)?;
        self.len += 1;
        Ok(())
    }
    fn logits(&mut self, row: usize) -> Result<&[f32], ForwardError> {
        if row != 0 {
            return Err(ForwardError::Device(format!("output row {row} of a one-row call")));
        }
        self.backend.logits()
    }
    fn sample(&mut self, picks: &mut [Pick<'_>]) -> Result<Vec<u32>, ForwardError> {
        let mut tokens = Vec::with_capacity(picks.len());
        for pick in picks.iter_mut() {
            if pick.row != 0 {
                return Err(ForwardError::Device(format!(
                    "output row {} of a one-row call",
                    pick.row
                )));
            }
            let token = match pick.allowed {
                Some(allowed) => self.backend.sample_masked(pick.sampler, allowed)?,
                None => self.backend.sample(pick.sampler)?,
            };
            tokens.push(token);
        }
        Ok(tokens)
    }
    fn synchronize(&mut self) -> Result<(), ForwardError> {
        self.backend.synchronize()
    }
    fn describe(&self) -> String {
        self.backend.describe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::CpuBackend;
    use crate::sampling::{Sampler, SamplingParams};

    fn tiny_model() -> CpuModel {
        let mut config = Config::tiny_shape();
        config.quantization = Config::from_json(&config.to_mlx_json()).unwrap().quantization;
        let checkpoint = crate::synth::checkpoint_in_memory(&config, 7).unwrap();
        CpuModel::new(crate::Weights::from_checkpoint(config, &checkpoint).unwrap())
    }

    fn prompt(len: usize, salt: u32, vocab: u32) -> Vec<u32> {
        (0..len as u32).map(|i| (i * 7919 + salt * 104_729) % vocab).collect()
    }

    /// Greedy tokens of `prompt` alone through the single-sequence backend.
    fn alone(prompt: &[u32], steps: usize) -> Vec<u32> {
        let mut backend = CpuBackend::new(tiny_model(), 1024);
        backend.prefill(prompt).unwrap();
        let mut sampler = Sampler::new(SamplingParams::default());
        let mut out = Vec::new();
        for _ in 0..steps {
            let token = backend.sample(&mut sampler).unwrap();
            out.push(token);
            backend.decode(token).unwrap();
        }
        out
    }

    #[test]
    fn rows_of_a_batch_match_each_sequence_alone_and_the_pool_is_accounted() {
        let model = tiny_model();
        let vocab = model.config().vocab_size as u32;
        let prompts: Vec<Vec<u32>> = [1, 70, 300]
            .iter()
            .enumerate()
            .map(|(i, &n)| prompt(n, i as u32, vocab))
            .collect();
        let steps = 6;
        let expected: Vec<Vec<u32>> = prompts.iter().map(|p| alone(p, steps)).collect();
        let mut batch = CpuBatchBackend::new(model, 1024, 4, 1024).with_snapshot_budget(1 << 30);
        assert_eq!(batch.free_tokens(), 1024);
        for (slot, p) in prompts.iter().enumerate() {
            assert!(batch.reserve(slot, p.len() + steps).unwrap());
        }
        let reserved: usize = prompts
            .iter()
            .map(|p| (p.len() + steps).div_ceil(CPU_POOL_UNIT) * CPU_POOL_UNIT)
            .sum();
        assert_eq!(reserved, 64 + 128 + 320);
        assert_eq!(batch.free_tokens(), 1024 - reserved);
        // More than the pool has left: refused, nothing changed.
        assert!(!batch.reserve(3, 600).unwrap());
        assert_eq!(batch.free_tokens(), 1024 - reserved);
        let mut sampler = Sampler::new(SamplingParams::default());
        let mut next = Vec::new();
        // Each prompt's first half enters alone where it has one, the second halves together in one call (output
        // row i for part i).
        for (slot, p) in prompts.iter().enumerate() {
            let half = p.len() / 2;
            if half > 0 {
                batch.prefill(slot, &p[..half]).unwrap();
            }
        }
        let parts: Vec<PrefillPart> = prompts
            .iter()
            .enumerate()
            .map(|(slot, p)| PrefillPart {
                slot,
                tokens: &p[p.len() / 2..],
                // The second prompt is also snapshotted inside its part, which must not change its tokens.
                cuts: if slot == 1 { &[10] } else { &[] },
            })
            .collect();
        // A call naming a slot twice or growing a slot past its reservation is refused before any part runs.
        let lens: Vec<usize> = (0..3).map(|slot| batch.len(slot)).collect();
        let twice = [parts[1], parts[2], parts[1]];
        assert!(matches!(batch.prefill_parts(&twice), Err(ForwardError::Device(_))));
        let too_long = vec![1; 400];
        let past = [
            parts[0],
            PrefillPart {
                slot: 2,
                tokens: &too_long,
                cuts: &[],
            },
        ];
        assert!(matches!(
            batch.prefill_parts(&past),
            Err(ForwardError::ContextFull { .. })
        ));
        assert_eq!(lens, (0..3).map(|slot| batch.len(slot)).collect::<Vec<_>>());
        let ids = batch.prefill_parts(&parts).unwrap();
        assert!(
            matches!(ids.as_slice(), [a, b, c] if a.is_empty() && c.is_empty() && matches!(b.as_slice(), [Some(_)])),
            "{ids:?}"
        );
        let snapshot_len = batch.snapshots.values().map(|s| s.position).collect::<Vec<_>>();
        assert_eq!(snapshot_len, vec![70 / 2 + 10]);
        for i in 0..prompts.len() {
            next.push(sampler.sample(batch.logits(i).unwrap()));
        }
        let mut got: Vec<Vec<u32>> = next.iter().map(|&t| vec![t]).collect();
        for _ in 1..steps {
            let rows: Vec<StepRow> = next
                .iter()
                .enumerate()
                .map(|(slot, &token)| StepRow { slot, token })
                .collect();
            batch.step(&rows).unwrap();
            for (i, out) in got.iter_mut().enumerate() {
                next[i] = sampler.sample(batch.logits(i).unwrap());
                out.push(next[i]);
            }
        }
        assert_eq!(got, expected);
        // A fork continues as its source does.
        assert!(batch.reserve(3, batch.len(1) + 4).unwrap());
        batch.fork(1, 3).unwrap();
        assert_eq!(batch.len(3), batch.len(1));
        let rows = [StepRow { slot: 1, token: 5 }, StepRow { slot: 3, token: 5 }];
        batch.step(&rows).unwrap();
        let first = batch.logits(0).unwrap().to_vec();
        assert_eq!(first, batch.logits(1).unwrap());
        // Past its reservation a slot refuses to grow.
        let room = batch.slots[3].reserved - batch.len(3);
        let err = batch.prefill(3, &vec![1; room + 1]).unwrap_err();
        assert!(matches!(err, ForwardError::ContextFull { .. }), "{err}");
        for slot in 0..4 {
            batch.release(slot);
            assert_eq!(batch.len(slot), 0);
        }
        assert_eq!(batch.free_tokens(), 1024);
    }

    #[test]
    fn single_slot_serves_a_backend_with_chunked_prefill() {
        let model = tiny_model();
        let vocab = model.config().vocab_size as u32;
        let p = prompt(300, 3, vocab);
        let expected = alone(&p, 5);
        let mut single = SingleSlot::new(Box::new(CpuBackend::new(model, 1024)));
        assert_eq!(single.max_seqs(), 1);
        assert!(!single.reserve(0, 1025).unwrap());
        assert!(single.reserve(0, 310).unwrap());
        assert_eq!(single.free_tokens(), 1024 - 310);
        single.prefill(0, &p[..100]).unwrap();
        single.prefill(0, &p[100..]).unwrap();
        let mut sampler = Sampler::new(SamplingParams::default());
        let mut got = Vec::new();
        for i in 0..5 {
            if i > 0 {
                single
                    .step(&[StepRow {
                        slot: 0,
                        token: got[i - 1],
                    }])
                    .unwrap();
            }
            let mut picks = [Pick {
                row: 0,
                sampler: &mut sampler,
                allowed: None,
            }];
            got.push(single.sample(&mut picks).unwrap()[0]);
        }
        assert_eq!(got, expected);
        assert!(single.fork(0, 0).is_err());
        single.release(0);
        assert_eq!(single.free_tokens(), 1024);
    }

    /// A sequence restored from a snapshot and continued gives the logits of one that prefilled everything, and
    /// the snapshot survives its source going on, being released, and other sequences reusing the pool.
    #[test]
    fn a_restored_snapshot_continues_as_a_full_prefill() {
        let model = tiny_model();
        let vocab = model.config().vocab_size as u32;
        let whole = prompt(230, 5, vocab);
        let (shared, rest) = whole.split_at(150);
        let mut batch = CpuBatchBackend::new(model, 1024, 3, 1024);
        // No budget: no snapshot.
        assert!(batch.reserve(0, 400).unwrap());
        batch.prefill(0, shared).unwrap();
        assert!(batch.snapshot(0).unwrap().is_none());
        let mut batch = batch.with_snapshot_budget(1 << 30);
        let id = batch.snapshot(0).unwrap().expect("room for one");
        assert!(batch.snapshot_bytes() > 0);
        // The source goes on with other tokens and is released: the snapshot is its own copy.
        batch.prefill(0, &prompt(40, 9, vocab)).unwrap();
        batch.release(0);
        assert!(batch.restore(id, 1, whole.len() + 4).unwrap());
        assert_eq!(batch.len(1), shared.len());
        assert!(
            batch.restore(id, 1, 8).is_err(),
            "a slot in use cannot be restored into"
        );
        batch.prefill(1, rest).unwrap();
        let restored = batch.logits(0).unwrap().to_vec();
        assert!(batch.reserve(2, whole.len()).unwrap());
        batch.prefill(2, &whole).unwrap();
        let full = batch.logits(0).unwrap().to_vec();
        let worst = full
            .iter()
            .zip(&restored)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(worst < 1e-4, "restored prefix differs from a full prefill by {worst}");
        assert_eq!(crate::sampling::argmax(&full), crate::sampling::argmax(&restored));
        // A restore the pool cannot hold is refused with the slot left empty.
        assert!(!batch.restore(id, 0, 1024).unwrap());
        assert_eq!(batch.len(0), 0);
        batch.drop_snapshot(id);
        assert_eq!(batch.snapshot_bytes(), 0);
        assert!(batch.restore(id, 0, 200).is_err());
    }

    /// Snapshots taken at cuts inside a prefill hold the sequence as it stood at each cut, and the prefill itself
    /// ends as one without cuts; cuts outside the prompt or out of order are refused before anything runs.
    #[test]
    fn prefill_snapshots_at_cuts_hold_each_prefix() {
        let model = tiny_model();
        let vocab = model.config().vocab_size as u32;
        let whole = prompt(120, 3, vocab);
        let mut batch = CpuBatchBackend::new(model, 1024, 4, 1024).with_snapshot_budget(1 << 30);
        assert!(batch.reserve(0, 200).unwrap());
        for bad in [&[0][..], &[120], &[50, 50], &[60, 40]] {
            assert!(batch.prefill_snapshot(0, &whole, bad).is_err(), "cuts {bad:?}");
            assert_eq!(batch.len(0), 0, "cuts {bad:?}");
        }
        let ids = batch.prefill_snapshot(0, &whole, &[17, 64]).unwrap();
        let cut_logits = batch.logits(0).unwrap().to_vec();
        assert_eq!(batch.len(0), 120);
        assert!(batch.reserve(1, 200).unwrap());
        batch.prefill(1, &whole).unwrap();
        assert_eq!(
            crate::sampling::argmax(&cut_logits),
            crate::sampling::argmax(batch.logits(0).unwrap())
        );
        for (id, cut) in ids.into_iter().zip([17, 64]) {
            let id = id.expect("room for the snapshot");
            batch.release(2);
            assert!(batch.restore(id, 2, 200).unwrap());
            assert_eq!(batch.len(2), cut);
            batch.prefill(2, &whole[cut..]).unwrap();
            let restored = batch.logits(0).unwrap().to_vec();
            let worst = cut_logits
                .iter()
                .zip(&restored)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            assert!(worst < 1e-4, "the snapshot at {cut} continued differs by {worst}");
        }
    }
}
