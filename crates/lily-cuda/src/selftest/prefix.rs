//! Prefix-cache snapshots in the batched backend: sequences restored from a snapshot and continued, and the
//! snapshot's source continued too, give the logits of fresh sequences that prefilled the same tokens; dropping
//! the snapshot and handing its freed pages to another sequence leaves a restored sequence unchanged; the pool's
//! and the snapshots' accounting adds up, and a restore the pool cannot hold changes nothing.
//!
//! A snapshot taken inside a prefill pass is checked against one taken between two calls.
//!
//! Tolerances: a restored sequence against a fresh one that prefilled the same tokens in the same calls is held to
//! 0 (the same arithmetic on the same values: the backend's products and sums are deterministic, which the fork
//! check relies on too); against a fresh one that prefilled the whole sequence in one call, to the default model's
//! tolerance for a prefill in chunks against one pass (6e-2, as in `compare_prefill`).

use lily_model::backend::{BatchBackend, PrefillPart, StepRow};
use lily_model::rng::Rng;
use lily_model::ForwardError;

use super::{rel_err, Report};
use crate::batch::CudaBatchBackend;
use crate::driver::{GpuError, Result};
use crate::pages::{pages_for, Capacity, KV_PAGE};

/// A prefill in chunks against one pass, on the default model (see `compare_prefill` in mod.rs).
const ONE_PASS_TOL: f64 = 6e-2;

fn fe(e: ForwardError) -> GpuError {
    GpuError::Other(e.to_string())
}

fn random_tokens(rng: &mut Rng, vocab: u64, n: usize) -> Vec<u32> {
    (0..n).map(|_| (rng.next_u64() % vocab) as u32).collect()
}

/// Appends `tokens` to the sequence in `slot`, in pieces of at most `max_prefill_tokens`; returns the last
/// token's next-token logits.
fn prefill(backend: &mut CudaBatchBackend, slot: usize, tokens: &[u32]) -> Result<Vec<f32>> {
    for piece in tokens.chunks(backend.max_prefill_tokens()) {
        backend.prefill(slot, piece).map_err(fe)?;
    }
    Ok(backend.logits(0).map_err(fe)?.to_vec())
}

fn reserve(backend: &mut CudaBatchBackend, slot: usize, tokens: usize) -> Result<()> {
    match backend.reserve(slot, tokens).map_err(fe)? {
        true => Ok(()),
        false => Err(GpuError::Other(format!(
            "no KV pages for {tokens} tokens in slot {slot}"
        ))),
    }
}

/// One step of `tokens[i]` in `slots[i]`; every row's logits.
fn step(backend: &mut CudaBatchBackend, slots: &[usize], tokens: &[u32]) -> Result<Vec<Vec<f32>>> {
    let rows: Vec<StepRow> = slots
        .iter()
        .zip(tokens)
        .map(|(&slot, &token)| StepRow { slot, token })
        .collect();
    backend.step(&rows).map_err(fe)?;
    (0..rows.len())
        .map(|row| Ok(backend.logits(row).map_err(fe)?.to_vec()))
        .collect()
}

/// The checks; the backend's slots and pool are empty before and after.
pub fn check(backend: &mut CudaBatchBackend, seed: u64, report: &mut Report) -> Result<()> {
    let mut rng = Rng::new(seed ^ 0x5a95);
    let sequential_below = backend.sequential_below;
    for n in [300, 4 * KV_PAGE] {
        continued(backend, &mut rng, n, report)?;
    }
    backend.sequential_below = sequential_below;
    in_pass(backend, &mut rng, report)?;
    limits(backend, &mut rng, report)
}

/// Snapshots taken inside one prefill pass (`prefill_snapshot`, two cuts) against ones taken between calls: the
/// sequence that was cut goes on as the one prefilled in three calls, and sequences restored from each pair of
/// snapshots continue alike. The two ways may run their products over different row counts, so they are held to
/// the one-pass tolerance, not exactly; a snapshot of the wrong position would be off by far more.
fn in_pass(backend: &mut CudaBatchBackend, rng: &mut Rng, report: &mut Report) -> Result<()> {
    let c = backend.config().clone();
    let vocab = c.vocab_size as u64;
    let (n, cuts) = (300, [101, 173]);
    let prompt = random_tokens(rng, vocab, n);
    let continuation = random_tokens(rng, vocab, 77);
    let room = n + 128;
    let (cut_slot, twin, restored, beside) = (0, 1, [2, 3, 4, 5], 6);
    let free_before = backend.free_tokens();
    reserve(backend, cut_slot, room)?;
    reserve(backend, twin, room)?;
    // The cut sequence shares its pass with another prompt, cut too (the server joins prompts so).
    let other = random_tokens(rng, vocab, 150);
    reserve(backend, beside, other.len())?;
    let parts = [
        PrefillPart {
            slot: cut_slot,
            tokens: &prompt,
            cuts: &cuts,
        },
        PrefillPart {
            slot: beside,
            tokens: &other,
            cuts: &[60],
        },
    ];
    let mut joined = backend.prefill_parts(&parts).map_err(fe)?;
    let in_pass = joined.swap_remove(0);
    let cut_logits = backend.logits(0).map_err(fe)?.to_vec();
    let mut between = Vec::new();
    let mut done = 0;
    for cut in cuts {
        prefill(backend, twin, &prompt[done..cut])?;
        between.push(backend.snapshot(twin).map_err(fe)?);
        done = cut;
    }
    let twin_logits = prefill(backend, twin, &prompt[done..])?;
    let ids: Option<Vec<usize>> = in_pass.iter().chain(&between).chain(&joined[0]).copied().collect();
    let Some(ids) = ids else {
        return Err(GpuError::Other("no snapshot buffer".into()));
    };
    // Restored: the in-pass snapshots into restored[0..2], the between-calls ones into restored[2..4].
    let mut lengths = Vec::new();
    for (&id, &slot) in ids.iter().zip(&restored) {
        if !backend.restore(id, slot, room).map_err(fe)? {
            return Err(GpuError::Other(
                "a restore was refused with the pool nearly empty".into(),
            ));
        }
        lengths.push(backend.len(slot));
    }
    let expected: Vec<usize> = cuts.iter().chain(&cuts).copied().collect();
    let beside_restored = 7;
    let beside_len = match backend
        .restore(ids[2 * cuts.len()], beside_restored, room)
        .map_err(fe)?
    {
        true => Some(backend.len(beside_restored)),
        false => None,
    };
    report.check_eq(
        "prefix snapshots inside a pass of two prompts: their lengths, restored",
        lengths == expected && backend.len(cut_slot) == n && beside_len == Some(60),
        &format!(
            "restored at {lengths:?} tokens (cuts at {cuts:?}); the cut sequence holds {} of {n}; the other \
             prompt's snapshot {beside_len:?} (cut at 60)",
            backend.len(cut_slot)
        ),
    );
    let mut worst = 0.0f64;
    for i in 0..cuts.len() {
        let got = prefill(backend, restored[i], &continuation)?;
        let want = prefill(backend, restored[i + cuts.len()], &continuation)?;
        worst = worst.max(rel_err(&got, &want));
    }
    report.check(
        "prefix snapshots inside a pass: restored, continued vs between calls",
        worst,
        ONE_PASS_TOL,
    );
    report.check(
        "prefix snapshots inside a pass: the cut sequence vs three calls",
        rel_err(&cut_logits, &twin_logits),
        ONE_PASS_TOL,
    );
    for slot in [cut_slot, twin, beside, beside_restored].into_iter().chain(restored) {
        backend.release(slot);
    }
    for id in ids {
        backend.drop_snapshot(id);
    }
    report.check_eq(
        "prefix snapshots inside a pass: every page back",
        backend.free_tokens() == free_before && backend.snapshot_bytes() == 0,
        &format!("{} of {free_before} tokens free", backend.free_tokens()),
    );
    Ok(())
}

/// A prompt of `n` tokens in slot A, a snapshot, restores into B and C; B, C and A go on differently, each against
/// a fresh slot fed the same tokens, and a restore made after A went on continues as C did; then the snapshot is
/// dropped, its freed pages overwritten by another sequence, and B goes on again against its fresh twin.
fn continued(backend: &mut CudaBatchBackend, rng: &mut Rng, n: usize, report: &mut Report) -> Result<()> {
    let c = backend.config().clone();
    let vocab = c.vocab_size as u64;
    let (state_bytes, page_bytes) = (Capacity::deltanet_bytes_per_seq(&c), Capacity::kv_bytes_per_page(&c));
    let prompt = random_tokens(rng, vocab, n);
    let continuation = [random_tokens(rng, vocab, 77), random_tokens(rng, vocab, 130)];
    let step_tokens = [random_tokens(rng, vocab, 3), random_tokens(rng, vocab, 3)];
    let (last_token, last_prefill) = (random_tokens(rng, vocab, 1)[0], random_tokens(rng, vocab, 10));
    let room = n + 256;
    // A, B, C; their fresh twins; a slot that takes the freed pages.
    let (a, b, c_slot, twins, other) = (0, 1, 2, [3, 4, 5], 6);
    let free_before = backend.free_tokens();
    let name = |what: &str| format!("prefix snapshot at {n} tokens: {what}");

    reserve(backend, a, room)?;
    let mut got = vec![prefill(backend, a, &prompt)?];
    let id = backend
        .snapshot(a)
        .map_err(fe)?
        .ok_or_else(|| GpuError::Other("no snapshot buffer".into()))?;
    let only_state = backend.snapshot_bytes() == state_bytes;
    let both = backend.restore(id, b, room).map_err(fe)? && backend.restore(id, c_slot, room).map_err(fe)?;
    // A holds its pages; B and C share the snapshot's full ones and hold fresh pages for the rest.
    let fresh = pages_for(room) - n / KV_PAGE;
    let free_expected = free_before - KV_PAGE * (pages_for(room) + 2 * fresh);
    report.check_eq(
        &name("restores share the full pages"),
        only_state && both && backend.len(b) == n && backend.len(c_slot) == n && backend.free_tokens() == free_expected,
        &format!(
            "snapshot bytes {} (its state {state_bytes}), {} tokens free (expected {free_expected})",
            backend.snapshot_bytes(),
            backend.free_tokens()
        ),
    );
    if !both {
        return Err(GpuError::Other(
            "a restore was refused with the pool nearly empty".into(),
        ));
    }
    for (slot, tokens) in [b, c_slot].into_iter().zip(&continuation) {
        got.push(prefill(backend, slot, tokens)?);
    }
    let mut fresh_logits = Vec::new();
    for (i, &twin) in twins.iter().enumerate() {
        reserve(backend, twin, room)?;
        let mut logits = prefill(backend, twin, &prompt)?;
        if i > 0 {
            logits = prefill(backend, twin, &continuation[i - 1])?;
        }
        fresh_logits.push(logits);
    }
    // B's whole sequence in one prefill call.
    let whole: Vec<u32> = prompt.iter().chain(&continuation[0]).copied().collect();
    reserve(backend, other, whole.len())?;
    let one_pass = prefill(backend, other, &whole)?;
    backend.release(other);
    let mut worst = (0..3).map(|i| rel_err(&got[i], &fresh_logits[i])).fold(0.0, f64::max);
    // A step through the batched pass, then one through the single-row graphs, of A, B and C and of their twins.
    for (tokens, below) in step_tokens.iter().zip([0, usize::MAX]) {
        backend.sequential_below = below;
        let stepped = step(backend, &[a, b, c_slot], tokens)?;
        let want = step(backend, &twins, tokens)?;
        worst = stepped
            .iter()
            .zip(&want)
            .map(|(g, w)| rel_err(g, w))
            .fold(worst, f64::max);
    }
    // A has now written positions n and n + 1, into the snapshot's partial last page where n is not a multiple of
    // KV_PAGE: a restore made now still starts from the snapshot's n tokens.
    let late = 7;
    if !backend.restore(id, late, room).map_err(fe)? {
        return Err(GpuError::Other(
            "a restore was refused with the pool nearly empty".into(),
        ));
    }
    let late_logits = prefill(backend, late, &continuation[1])?;
    worst = worst.max(rel_err(&late_logits, &fresh_logits[2]));
    backend.release(late);
    report.check(
        &name("A, B, C (prefill, 2 steps), a later restore vs fresh"),
        worst,
        0.0,
    );
    report.check(
        &name("B's prefill vs the whole sequence in one pass"),
        rel_err(&got[1], &one_pass),
        ONE_PASS_TOL,
    );

    // The snapshot outlives its source: its partial last page (where n is not a multiple of KV_PAGE) is its alone.
    // Its pages are A's first ones, so A's and C's pages that B does not share are those the drop below frees.
    let b_pages = backend.model.pages.pages(b).to_vec();
    let freed: Vec<i32> = [a, c_slot]
        .iter()
        .flat_map(|&s| backend.model.pages.pages(s).to_vec())
        .filter(|p| !b_pages.contains(p))
        .collect();
    backend.release(a);
    backend.release(c_slot);
    let partial = if !n.is_multiple_of(KV_PAGE) { page_bytes } else { 0 };
    let outlives = backend.snapshot_bytes() == state_bytes + partial;
    // Dropped while B runs: every page B does not share goes to slot `other`, which overwrites all of them.
    backend.drop_snapshot(id);
    let dropped = backend.snapshot_bytes() == 0;
    let max_context = backend.max_context();
    reserve(backend, other, max_context)?;
    let other_pages = backend.model.pages.pages(other).to_vec();
    let reused = freed.iter().all(|p| other_pages.contains(p)) && !b_pages.iter().any(|p| other_pages.contains(p));
    report.check_eq(
        &name("snapshot bytes, its drop, the freed pages reused"),
        outlives && dropped && reused,
        &format!(
            "{} freed pages all taken by another sequence and none of B's: {reused}; the snapshot held its own \
             partial page: {outlives}; nothing after its drop: {dropped}",
            freed.len()
        ),
    );
    let filler = random_tokens(rng, vocab, max_context);
    prefill(backend, other, &filler)?;
    backend.release(other);
    let b_twin = twins[1];
    backend.sequential_below = 0;
    let got = step(backend, &[b], &[last_token])?;
    let want = step(backend, &[b_twin], &[last_token])?;
    let stepped = rel_err(&got[0], &want[0]);
    let got = prefill(backend, b, &last_prefill)?;
    let want = prefill(backend, b_twin, &last_prefill)?;
    report.check(
        &name("B after the drop and reuse (step, prefill) vs fresh"),
        stepped.max(rel_err(&got, &want)),
        0.0,
    );
    for slot in [b].into_iter().chain(twins) {
        backend.release(slot);
    }
    report.check_eq(
        &name("every page back"),
        backend.free_tokens() == free_before && backend.snapshot_bytes() == 0,
        &format!("{} of {free_before} tokens free", backend.free_tokens()),
    );
    Ok(())
}

/// Full snapshot buffers give `None`; with the pool empty, a restore that needs a fresh page is refused and leaves
/// the slot empty, while a restore at a page boundary needs none and succeeds; a restore into a busy slot or from a
/// dropped snapshot is an error.
fn limits(backend: &mut CudaBatchBackend, rng: &mut Rng, report: &mut Report) -> Result<()> {
    let vocab = backend.config().vocab_size as u64;
    let max_context = backend.max_context();
    let free_before = backend.free_tokens();
    let (source, target) = (0, 1);
    let aligned = (max_context / KV_PAGE - 1) * KV_PAGE;
    let partial = aligned + 28;
    reserve(backend, source, max_context)?;
    prefill(backend, source, &random_tokens(rng, vocab, aligned))?;
    let mut ids = vec![backend.snapshot(source).map_err(fe)?];
    prefill(backend, source, &random_tokens(rng, vocab, partial - aligned))?;
    while let Some(id) = backend.snapshot(source).map_err(fe)? {
        ids.push(Some(id));
    }
    let buffers = backend.model.state.snapshots;
    report.check_eq(
        "prefix snapshots: as many as there are buffers, then none",
        ids.len() == buffers && ids.iter().all(Option::is_some),
        &format!("{} taken of {buffers} buffers", ids.len()),
    );
    let (Some(at_boundary), Some(past_it)) = (ids[0], ids[1]) else {
        return Err(GpuError::Other("the selftest needs two snapshot buffers".into()));
    };
    // Every page taken: the snapshots hold the source's pages, and every slot but `target` (the source too, after
    // letting go of its own) reserves the whole context.
    backend.release(source);
    for slot in (0..backend.max_seqs()).filter(|&s| s != target) {
        if backend.free_tokens() == 0 {
            break;
        }
        let tokens = backend.free_tokens().min(max_context);
        reserve(backend, slot, tokens)?;
    }
    if backend.free_tokens() != 0 {
        return Err(GpuError::Other(format!(
            "{} tokens still free: the selftest's pool is larger than its slots",
            backend.free_tokens()
        )));
    }
    let refused = !backend.restore(past_it, target, partial).map_err(fe)?
        && !backend.restore(at_boundary, target, aligned + 1).map_err(fe)?
        && backend.len(target) == 0
        && backend.model.pages.pages(target).is_empty()
        && backend.free_tokens() == 0;
    let shared = backend.restore(at_boundary, target, aligned).map_err(fe)? && backend.len(target) == aligned;
    let busy = backend.restore(past_it, target, partial).is_err();
    for id in ids.iter().flatten() {
        backend.drop_snapshot(*id);
    }
    let dropped = backend.restore(at_boundary, 2, aligned).is_err();
    report.check_eq(
        "prefix snapshots: restores with the pool empty, and bad ones",
        refused && shared && busy && dropped,
        &format!(
            "needing a fresh page refused: {refused}; at a page boundary shared: {shared}; into a busy slot an \
             error: {busy}; from a dropped snapshot an error: {dropped}"
        ),
    );
    for slot in 0..backend.max_seqs() {
        backend.release(slot);
    }
    report.check_eq(
        "prefix snapshots: every page back",
        backend.free_tokens() == free_before && backend.snapshot_bytes() == 0,
        &format!("{} of {free_before} tokens free", backend.free_tokens()),
    );
    Ok(())
}
