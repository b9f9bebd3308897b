//! The CPU batch backend on the bundled trained model: sequences of mixed prompt lengths prefilled in chunks and
//! stepped together, joining at different times, give the same greedy tokens as each alone.

use lily_model::cpu::CpuModel;
use lily_model::sampling::argmax;
use lily_model::{Backend, BatchBackend, CpuBackend, CpuBatchBackend, StepRow, Weights};

fn model() -> CpuModel {
    let dir = lily_model::default_model::locate().expect("the bundled model");
    CpuModel::new(Weights::load(&dir).expect("weights"))
}

/// A prompt of `len` ordinary tokens (ids the tokenizer's plain text uses), different for each `salt`.
fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32).map(|i| 200 + (i * 131 + salt * 977) % 5000).collect()
}

fn alone(backend: &mut CpuBackend, prompt: &[u32], steps: usize) -> Vec<u32> {
    backend.prefill(prompt).unwrap();
    let mut out = Vec::new();
    for _ in 0..steps {
        let token = argmax(backend.logits().unwrap());
        out.push(token);
        backend.decode(token).unwrap();
    }
    out
}

#[test]
fn sequences_run_together_give_the_greedy_tokens_they_give_alone() {
    let lengths = [1, 9, 64, 200, 333, 700];
    let steps = 12;
    let prompts: Vec<Vec<u32>> = lengths.iter().enumerate().map(|(i, &n)| prompt(n, i as u32)).collect();
    let mut single = CpuBackend::new(model(), 1024);
    let expected: Vec<Vec<u32>> = prompts.iter().map(|p| alone(&mut single, p, steps)).collect();
    drop(single);

    let mut batch = CpuBatchBackend::new(model(), 1024, lengths.len(), lengths.len() * 1024);
    let mut out: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
    let mut done = vec![0usize; prompts.len()];
    // Each iteration prefills a chunk of at most 128 tokens of the first unfinished prompt, then steps every
    // sequence whose prompt is in: sequences join the batch at different times and positions.
    while out.iter().any(|o| o.len() < steps) {
        if let Some(slot) = (0..prompts.len()).find(|&s| done[s] < prompts[s].len()) {
            if done[slot] == 0 {
                assert!(batch.reserve(slot, prompts[slot].len() + steps).unwrap());
            }
            let end = prompts[slot].len().min(done[slot] + 128);
            batch.prefill(slot, &prompts[slot][done[slot]..end]).unwrap();
            done[slot] = end;
            if end == prompts[slot].len() {
                out[slot].push(argmax(batch.logits(0).unwrap()));
            }
        }
        let rows: Vec<StepRow> = (0..prompts.len())
            .filter(|&s| done[s] == prompts[s].len() && !out[s].is_empty() && out[s].len() < steps)
            .map(|s| StepRow {
                slot: s,
                token: *out[s].last().unwrap(),
            })
            .collect();
        if rows.is_empty() {
            continue;
        }
        batch.step(&rows).unwrap();
        for (i, row) in rows.iter().enumerate() {
            out[row.slot].push(argmax(batch.logits(i).unwrap()));
        }
    }
    for (slot, (got, want)) in out.iter().zip(&expected).enumerate() {
        assert_eq!(got, want, "prompt of {} tokens", lengths[slot]);
    }
    for slot in 0..prompts.len() {
        batch.release(slot);
    }
    assert_eq!(batch.free_tokens(), lengths.len() * 1024);
}
