//! Peak host memory of loading a checkpoint, for the load-memory figures in bench/RESULTS.md.
//!
//! `cargo run --release -p lily-model --example load_memory -- DIR [--upload | --cpu]` loads DIR and prints the
//! process's peak resident memory (VmHWM) and its anonymous and file-backed parts. `--upload` then reads every
//! quantized matrix's bytes as the GPU upload does (from the map, no aligned copy); `--cpu` reads each as a typed
//! slice as the CPU backend does (copying the tensors whose data is not aligned).
//!
//! `--write LAYOUT DIR` first writes a checkpoint at the real widths (hidden 2048, 256 experts, the real
//! vocabulary) with LAYERS layers (`--layers`, default 4) in a published layout (hf-release, mlx-vlm, ...).

use std::path::PathBuf;

use lily_model::config::LayerKind;
use lily_model::quant::QMatrix;
use lily_model::synth::{write_published, Published};
use lily_model::weights::Mixer;
use lily_model::{Config, Weights};

fn status_kib(key: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix(key))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn report(stage: &str) {
    println!(
        "{stage}: peak resident {:.2} GB (now: anonymous {:.2} GB, file-backed {:.2} GB)",
        status_kib("VmHWM:") as f64 / 1e6 * 1.024,
        status_kib("RssAnon:") as f64 / 1e6 * 1.024,
        status_kib("RssFile:") as f64 / 1e6 * 1.024
    );
}

fn matrices(w: &Weights) -> Vec<&QMatrix> {
    let mut out = vec![&w.embed_tokens, &w.lm_head];
    for l in &w.layers {
        match &l.mixer {
            Mixer::Linear(g) => out.extend([&g.in_proj_qkv, &g.in_proj_z, &g.in_proj_a, &g.in_proj_b, &g.out_proj]),
            Mixer::Full(a) => out.extend([&a.q_proj, &a.k_proj, &a.v_proj, &a.o_proj]),
        }
        let m = &l.moe;
        out.extend([
            &m.router,
            &m.experts_gate,
            &m.experts_up,
            &m.experts_down,
            &m.shared_gate,
            &m.shared_up,
            &m.shared_down,
            &m.shared_expert_gate,
        ]);
    }
    out
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let flag = |name: &str| args.iter().any(|a| a == name);
    let value = |name: &str| args.iter().position(|a| a == name).map(|i| args[i + 1].clone());
    if let Some(layout) = value("--write") {
        let layout = match layout.as_str() {
            "hf-release" => Published::HfRelease,
            "hf-per-expert" => Published::HfPerExpert,
            "mlx-lm" => Published::MlxLm,
            "mlx-vlm" => Published::MlxVlm,
            "mlx-bf16" => Published::MlxBf16,
            other => panic!("unknown layout {other}"),
        };
        let layers: usize = value("--layers").map_or(4, |n| n.parse().unwrap());
        let mut config = Config::full_shape();
        config.num_hidden_layers = layers;
        config.layer_types = (0..layers)
            .map(|i| {
                if i % 4 == 3 || i + 1 == layers {
                    LayerKind::Full
                } else {
                    LayerKind::Linear
                }
            })
            .collect();
        let dir = PathBuf::from(args.last().unwrap());
        write_published(&config, 1, layout, &dir).unwrap();
        println!("wrote {}", dir.display());
        return;
    }
    let dir = PathBuf::from(&args[0]);
    let start = std::time::Instant::now();
    let weights = Weights::load(&dir).unwrap();
    println!(
        "loaded {} ({:.2} GB of weights) in {:.1} s",
        dir.display(),
        weights.bytes() as f64 / 1e9,
        start.elapsed().as_secs_f64()
    );
    report("after load");
    if flag("--upload") {
        let mut checksum = 0u64;
        for m in matrices(&weights) {
            for bytes in [m.packed.as_bytes(), m.scales.as_bytes(), m.biases.as_bytes()] {
                checksum = bytes
                    .iter()
                    .step_by(4096)
                    .fold(checksum, |h, b| h.wrapping_mul(31).wrapping_add(*b as u64));
            }
        }
        println!("read every matrix's bytes (checksum {checksum:x})");
        report("after reading as bytes");
    }
    if flag("--cpu") {
        let mut total = 0usize;
        for m in matrices(&weights) {
            total += m.packed.as_slice().len() + m.scales.as_slice().len() + m.biases.as_slice().len();
        }
        println!("read every matrix as a typed slice ({total} elements)");
        report("after reading as slices");
    }
}
