//! The CPU backend against Hugging Face transformers (`scripts/golden.py`): logits at every prompt position and
//! greedy continuations, on the trained default model and on a synthetic tiny model; and decode against prefill.
//! All of it on every SIMD path of the quantized products that the CPU has.

use std::path::Path;
use std::sync::OnceLock;

use lily_model::cpu::linalg::{simd_path, SIMD_ENV};
use lily_model::cpu::simd::Path as SimdPath;
use lily_model::cpu::CpuModel;
use lily_model::sampling::argmax;
use lily_model::{default_model, synth, Config, Weights};
use safetensors::SafeTensors;

/// Largest difference allowed between a lily logit and transformers' (both f32 on the same dequantized weights;
/// the difference is summation order only).
const LOGIT_ABS_TOLERANCE: f32 = 5e-4;
/// Names the longest prompt (in tokens) and the longest greedy continuation the tests below run, when set: under
/// an emulator (scripts/test_aarch64.sh) the whole golden files take many minutes, so the Arm check compares the
/// short prompts and the start of their continuations. Unset, everything runs.
const MAX_TOKENS_ENV: &str = "LILY_GOLDEN_MAX_TOKENS";
/// Seed of the synthetic tiny model the golden file was made from (`lily synth --shape tiny --seed 1`).
const SYNTH_SEED: u64 = 1;

fn max_tokens() -> usize {
    match std::env::var(MAX_TOKENS_ENV) {
        Ok(n) => n
            .parse()
            .unwrap_or_else(|_| panic!("{MAX_TOKENS_ENV}={n} is not a number")),
        Err(_) => usize::MAX,
    }
}

fn golden_path(name: &str) -> String {
    format!("{}/tests/golden/{name}.safetensors", env!("CARGO_MANIFEST_DIR"))
}

fn shakespeare() -> &'static CpuModel {
    static MODEL: OnceLock<CpuModel> = OnceLock::new();
    MODEL.get_or_init(|| CpuModel::new(Weights::load(&default_model::locate().unwrap()).unwrap()))
}

fn synthetic_tiny() -> &'static CpuModel {
    static MODEL: OnceLock<CpuModel> = OnceLock::new();
    MODEL.get_or_init(|| {
        let mut config = Config::tiny_shape();
        config.quantization = Config::from_json(&config.to_mlx_json()).unwrap().quantization;
        let ckpt = synth::checkpoint_in_memory(&config, SYNTH_SEED).unwrap();
        CpuModel::new(Weights::from_checkpoint(config, &ckpt).unwrap())
    })
}

fn ints(st: &SafeTensors, name: &str) -> Vec<u32> {
    let t = st.tensor(name).unwrap();
    t.data()
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()) as u32)
        .collect()
}

fn floats(st: &SafeTensors, name: &str) -> Vec<f32> {
    let t = st.tensor(name).unwrap();
    t.data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

struct Errors {
    max_abs: f32,
    max_rel: f32,
}

/// Compares every prompt of a golden file; returns the worst logit errors.
fn compare_with_golden(model: &CpuModel, name: &str) -> Errors {
    let bytes = std::fs::read(golden_path(name)).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let sample_ids = ints(&st, "sample_ids");
    let vocab = model.config().vocab_size;
    let mut errors = Errors {
        max_abs: 0.0,
        max_rel: 0.0,
    };
    let prompts = (0..).take_while(|i| st.tensor(&format!("p{i}.tokens")).is_ok()).count();
    assert!(prompts >= 4, "{name}: only {prompts} prompts");
    let mut compared = 0;
    for p in 0..prompts {
        let tokens = ints(&st, &format!("p{p}.tokens"));
        if tokens.len() > max_tokens() {
            eprintln!("{name} prompt {p}: {} tokens, skipped ({MAX_TOKENS_ENV})", tokens.len());
            continue;
        }
        compared += 1;
        let top_ids = ints(&st, &format!("p{p}.top_ids"));
        let top_logits = floats(&st, &format!("p{p}.top_logits"));
        let sample_logits = floats(&st, &format!("p{p}.sample_logits"));
        let mut greedy = ints(&st, &format!("p{p}.greedy"));
        greedy.truncate(max_tokens());
        let top_k = top_ids.len() / tokens.len();

        let mut state = model.new_state(tokens.len() + greedy.len() + 1);
        let logits = model.prefill_all_logits(&mut state, &tokens).unwrap();
        for t in 0..tokens.len() {
            let row = &logits[t * vocab..(t + 1) * vocab];
            let expected = top_ids[t * top_k..(t + 1) * top_k]
                .iter()
                .zip(&top_logits[t * top_k..(t + 1) * top_k])
                .chain(
                    sample_ids
                        .iter()
                        .zip(&sample_logits[t * sample_ids.len()..(t + 1) * sample_ids.len()]),
                );
            for (&id, &want) in expected {
                let got = row[id as usize];
                assert!(got.is_finite(), "{name} prompt {p} position {t} token {id}: {got}");
                let abs = (got - want).abs();
                errors.max_abs = errors.max_abs.max(abs);
                errors.max_rel = errors.max_rel.max(abs / want.abs().max(1.0));
                assert!(
                    abs <= LOGIT_ABS_TOLERANCE,
                    "{name} prompt {p} position {t} token {id}: lily {got} transformers {want}"
                );
            }
            // The top logit is lily's top logit too (ties between identical rows are broken by lowest id).
            assert_eq!(
                argmax(row),
                top_ids[t * top_k],
                "{name} prompt {p} position {t}: argmax differs"
            );
        }

        // Greedy continuation: prefill's last logits, then decode steps.
        let mut next = argmax(&logits[(tokens.len() - 1) * vocab..]);
        let mut ours = vec![next];
        let mut step_logits = vec![0.0; vocab];
        while ours.len() < greedy.len() {
            model.decode(&mut state, next, &mut step_logits).unwrap();
            next = argmax(&step_logits);
            ours.push(next);
        }
        assert_eq!(ours, greedy, "{name} prompt {p}: greedy continuation differs");
    }
    assert!(compared >= 3, "{name}: only {compared} prompts compared");
    eprintln!(
        "{name}: max abs logit error {:.2e}, max rel {:.2e}",
        errors.max_abs, errors.max_rel
    );
    errors
}

#[test]
fn default_model_matches_transformers() {
    let errors = compare_with_golden(shakespeare(), "lily-tiny-shakespeare");
    assert!(
        errors.max_abs > 0.0,
        "suspiciously exact: is the comparison reading the right data?"
    );
}

#[test]
fn synthetic_tiny_model_matches_transformers() {
    let path = golden_path("synth-tiny-seed1");
    assert!(
        Path::new(&path).exists(),
        "missing {path}: regenerate with scripts/golden.py"
    );
    compare_with_golden(synthetic_tiny(), "synth-tiny-seed1");
}

/// Prefill of N tokens gives the same last logits as prefill of N-1 followed by one decode step, across the
/// DeltaNet chunk boundary (64) and the prefill slice boundary.
#[test]
fn decode_continues_prefill_exactly() {
    for model in [shakespeare(), synthetic_tiny()] {
        let vocab = model.config().vocab_size;
        for n in [2, 64, 65, 130, 257, 300].into_iter().filter(|&n| n <= max_tokens()) {
            let tokens: Vec<u32> = (0..n as u32).map(|i| (i * 7919 + 13) % 20000 + 200).collect();
            let mut whole = model.new_state(n);
            let mut a = vec![0.0; vocab];
            model.prefill(&mut whole, &tokens, &mut a).unwrap();
            let mut split = model.new_state(n);
            let mut b = vec![0.0; vocab];
            model.prefill(&mut split, &tokens[..n - 1], &mut b).unwrap();
            model.decode(&mut split, tokens[n - 1], &mut b).unwrap();
            let max = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
            assert!(max < 1e-3, "n {n}: prefill vs prefill+decode differ by {max}");
            assert_eq!(argmax(&a), argmax(&b));
        }
    }
}

#[test]
fn context_limit_is_an_error_not_a_panic() {
    let model = shakespeare();
    let mut state = model.new_state(8);
    let mut logits = vec![0.0; model.config().vocab_size];
    assert!(model.prefill(&mut state, &[1; 9], &mut logits).is_err());
    model.prefill(&mut state, &[1; 8], &mut logits).unwrap();
    assert!(model.decode(&mut state, 1, &mut logits).is_err());
    assert!(model.prefill(&mut model.new_state(8), &[], &mut logits).is_err());
    assert!(model
        .prefill(&mut model.new_state(8), &[u32::MAX], &mut logits)
        .is_err());
}

/// The tests this file runs again under each SIMD path.
const PER_PATH: [&str; 4] = [
    "default_model_matches_transformers",
    "synthetic_tiny_model_matches_transformers",
    "decode_continues_prefill_exactly",
    "the_simd_path_is_the_one_asked_for",
];

/// The path is chosen once per process, so each other path this CPU has runs the golden tests in a child process
/// of this test binary with the path forced by the environment (the tests above run the fastest path here).
#[test]
fn golden_tests_pass_on_every_simd_path() {
    if std::env::var_os(SIMD_ENV).is_some() {
        // A child (or a run with the path forced by hand) checks its one path through the tests above.
        return;
    }
    let others: Vec<SimdPath> = SimdPath::available()
        .into_iter()
        .filter(|&p| p != SimdPath::best())
        .collect();
    eprintln!(
        "this process ran {}; children run {:?}",
        SimdPath::best().name(),
        others.iter().map(|p| p.name()).collect::<Vec<_>>()
    );
    for path in others {
        let output = std::process::Command::new(std::env::current_exe().unwrap())
            .args(PER_PATH)
            .args(["--exact", "--nocapture"])
            .env(SIMD_ENV, path.name())
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&output.stdout).into_owned() + &String::from_utf8_lossy(&output.stderr);
        assert!(output.status.success(), "{} path:\n{text}", path.name());
        assert!(
            text.contains(&format!("{} passed", PER_PATH.len())),
            "{} path ran other tests than expected:\n{text}",
            path.name()
        );
        eprintln!("{} path: {} tests passed", path.name(), PER_PATH.len());
    }
}

#[test]
fn the_simd_path_is_the_one_asked_for() {
    match std::env::var(SIMD_ENV) {
        Ok(name) => assert_eq!(simd_path().name(), name, "{SIMD_ENV}={name}"),
        Err(_) => assert_eq!(simd_path(), SimdPath::best()),
    }
}
