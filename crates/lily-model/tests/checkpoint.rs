//! Loading checkpoints: the synthetic MLX directory, an HF bf16 directory quantized at load, and every kind of
//! damaged checkpoint, which must give an error naming the file (and tensor), never a panic.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use half::bf16;
use lily_model::checkpoint::CheckpointError;
use lily_model::cpu::CpuModel;
use lily_model::quant::QMatrix;
use lily_model::weights::Mixer;
use lily_model::{synth, Config, Weights};
use safetensors::{Dtype, SafeTensors};

fn write_tiny(dir: &Path) -> PathBuf {
    let out = dir.join("tiny");
    synth::write_dir(&Config::tiny_shape(), 3, &out, &|_, _| {}).unwrap();
    out
}

fn load_err(dir: &Path) -> String {
    match Weights::load(dir) {
        Ok(_) => panic!("{} loaded although it is damaged", dir.display()),
        Err(e) => e.to_string(),
    }
}

fn shard_of(dir: &Path, tensor: &str) -> PathBuf {
    let index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("model.safetensors.index.json")).unwrap()).unwrap();
    dir.join(index["weight_map"][tensor].as_str().unwrap())
}

/// Rewrites the shard holding `tensor` with `edit` applied to that tensor (None drops it).
fn rewrite_tensor(
    dir: &Path,
    tensor: &str,
    edit: impl Fn(Dtype, Vec<usize>, Vec<u8>) -> Option<(Dtype, Vec<usize>, Vec<u8>)>,
) {
    let path = shard_of(dir, tensor);
    let bytes = std::fs::read(&path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut kept: BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)> = BTreeMap::new();
    for (name, view) in st.tensors() {
        let entry = (view.dtype(), view.shape().to_vec(), view.data().to_vec());
        if name == tensor {
            if let Some(e) = edit(entry.0, entry.1, entry.2) {
                kept.insert(name, e);
            }
        } else {
            kept.insert(name, entry);
        }
    }
    let views: Vec<(String, safetensors::tensor::TensorView)> = kept
        .iter()
        .map(|(n, (d, s, b))| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &path).unwrap();
}

const SCALES: &str = "language_model.model.layers.1.mlp.switch_mlp.up_proj.scales";

#[test]
fn synthetic_directory_loads_and_runs() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = write_tiny(tmp.path());
    let shards = std::fs::read_dir(&dir)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .ends_with(".safetensors")
        })
        .count();
    assert!(shards >= 2, "the tiny synthetic model should be sharded, got {shards}");
    for file in [
        "config.json",
        "tokenizer.json",
        "chat_template.jinja",
        "model.safetensors.index.json",
    ] {
        assert!(dir.join(file).is_file(), "{file} missing");
    }
    let model = CpuModel::new(Weights::load(&dir).unwrap());
    let mut state = model.new_state(16);
    let mut logits = vec![0.0; model.config().vocab_size];
    model.prefill(&mut state, &[760, 3841, 13477], &mut logits).unwrap();
    assert!(logits.iter().all(|l| l.is_finite()));
    // Writing again into a non-empty directory is refused rather than clobbering it.
    assert!(synth::write_dir(&Config::tiny_shape(), 3, &dir, &|_, _| {}).is_err());
}

#[test]
fn missing_tensor_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = write_tiny(tmp.path());
    rewrite_tensor(&dir, SCALES, |_, _, _| None);
    let err = load_err(&dir);
    assert!(err.contains(SCALES), "{err}");
}

#[test]
fn wrong_shape_and_dtype_are_named_with_their_file() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = write_tiny(tmp.path());
    let shard = shard_of(&dir, SCALES);
    rewrite_tensor(&dir, SCALES, |d, mut s, b| {
        s.swap(0, 1);
        Some((d, s, b))
    });
    let err = load_err(&dir);
    assert!(
        err.contains(SCALES) && err.contains(&shard.file_name().unwrap().to_string_lossy().to_string()),
        "{err}"
    );
    assert!(err.contains("expected"), "{err}");

    let dir2 = tmp.path().join("dtype");
    synth::write_dir(&Config::tiny_shape(), 3, &dir2, &|_, _| {}).unwrap();
    rewrite_tensor(&dir2, SCALES, |_, s, b| Some((Dtype::F16, s, b)));
    let err = load_err(&dir2);
    assert!(err.contains(SCALES) && err.contains("F16"), "{err}");
}

/// A NaN or an infinity in a float tensor (a norm's weight) or in a quantized module's scales or biases is refused
/// at load, naming the tensor and the element: finite weights are what the backends assume.
#[test]
fn weights_that_are_not_finite_are_named() {
    const NORM: &str = "language_model.model.layers.0.input_layernorm.weight";
    const BIASES: &str = "language_model.model.layers.2.mlp.switch_mlp.down_proj.biases";
    let tmp = tempfile::tempdir().unwrap();
    for (i, (tensor, value)) in [(NORM, f32::NAN), (SCALES, f32::INFINITY), (BIASES, f32::NEG_INFINITY)]
        .into_iter()
        .enumerate()
    {
        let dir = tmp.path().join(format!("case{i}"));
        synth::write_dir(&Config::tiny_shape(), 3, &dir, &|_, _| {}).unwrap();
        rewrite_tensor(&dir, tensor, |d, s, mut b| {
            assert_eq!(d, Dtype::BF16, "{tensor}");
            b[6..8].copy_from_slice(&bf16::from_f32(value).to_le_bytes());
            Some((d, s, b))
        });
        let err = load_err(&dir);
        assert!(
            err.contains(tensor) && err.contains("element 3") && err.contains("not a finite number"),
            "{err}"
        );
    }
}

#[test]
fn truncated_and_corrupt_shards_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = write_tiny(tmp.path());
    let shard = shard_of(&dir, SCALES);
    let name = shard.file_name().unwrap().to_string_lossy().to_string();
    let bytes = std::fs::read(&shard).unwrap();

    std::fs::write(&shard, &bytes[..bytes.len() - 1000]).unwrap();
    let err = load_err(&dir);
    assert!(err.contains(&name), "{err}");

    let mut corrupt = bytes.clone();
    corrupt[8..40].copy_from_slice(&[b'#'; 32]);
    std::fs::write(&shard, &corrupt).unwrap();
    let err = load_err(&dir);
    assert!(err.contains(&name) && err.contains("corrupt"), "{err}");

    let mut huge_header = bytes.clone();
    huge_header[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    std::fs::write(&shard, &huge_header).unwrap();
    let err = load_err(&dir);
    assert!(err.contains(&name), "{err}");

    std::fs::write(&shard, b"").unwrap();
    let err = load_err(&dir);
    assert!(err.contains(&name), "{err}");
}

#[test]
fn index_problems_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = write_tiny(tmp.path());
    let shard = shard_of(&dir, SCALES);
    let name = shard.file_name().unwrap().to_string_lossy().to_string();
    std::fs::remove_file(&shard).unwrap();
    let err = load_err(&dir);
    assert!(err.contains(&name) && err.contains("does not exist"), "{err}");

    let index = dir.join("model.safetensors.index.json");
    std::fs::write(&index, "{\"weight_map\": {\"x\": \"../../etc/passwd\"}}").unwrap();
    assert!(load_err(&dir).contains("invalid shard"));
    std::fs::write(&index, "{not json").unwrap();
    assert!(load_err(&dir).contains("model.safetensors.index.json"));
}

#[test]
fn missing_or_bad_config_and_empty_directory() {
    let tmp = tempfile::tempdir().unwrap();
    assert!(load_err(tmp.path()).contains("config.json"));
    let dir = write_tiny(tmp.path());
    std::fs::write(
        dir.join("config.json"),
        "{\"text_config\": {\"model_type\": \"qwen3_5_moe\"}}",
    )
    .unwrap();
    let err = load_err(&dir);
    assert!(err.contains("config field") && err.contains("missing"), "{err}");
    let cfg = Config::tiny_shape().to_mlx_json();
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let p = entry.unwrap().path();
        if p.extension().is_some_and(|e| e == "safetensors" || e == "json") && !p.ends_with("config.json") {
            std::fs::remove_file(p).unwrap();
        }
    }
    let err = load_err(&dir);
    assert!(err.contains("no model.safetensors"), "{err}");
}

#[test]
fn a_config_that_does_not_match_the_tensors_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = write_tiny(tmp.path());
    let mut config = Config::tiny_shape();
    config.moe_intermediate_size = 128;
    std::fs::write(dir.join("config.json"), config.to_mlx_json().to_string()).unwrap();
    let err = load_err(&dir);
    assert!(err.contains("switch_mlp") && err.contains("expected"), "{err}");
}

fn dequantized(m: &QMatrix) -> Vec<f32> {
    let mut out = vec![0.0; m.rows * m.cols];
    let v = m.view();
    for r in 0..m.rows {
        v.dequantize_row(r, &mut out[r * m.cols..(r + 1) * m.cols]);
    }
    out
}

/// Writes `weights` as an HF bf16 checkpoint (`model.language_model.*`, fused experts, norms as offsets).
fn write_hf(weights: &Weights, dir: &Path) {
    let c = &weights.config;
    let tensors = std::cell::RefCell::new(Vec::<(String, Vec<usize>, Vec<f32>)>::new());
    let p = "model.language_model";
    let matrix = |name: String, m: &QMatrix| tensors.borrow_mut().push((name, vec![m.rows, m.cols], dequantized(m)));
    let matrix_shaped =
        |name: String, shape: Vec<usize>, values: Vec<f32>| tensors.borrow_mut().push((name, shape, values));
    matrix(format!("{p}.embed_tokens.weight"), &weights.embed_tokens);
    matrix("lm_head.weight".into(), &weights.lm_head);
    for (l, layer) in weights.layers.iter().enumerate() {
        let lp = format!("{p}.layers.{l}");
        match &layer.mixer {
            Mixer::Linear(g) => {
                matrix(format!("{lp}.linear_attn.in_proj_qkv.weight"), &g.in_proj_qkv);
                matrix(format!("{lp}.linear_attn.in_proj_z.weight"), &g.in_proj_z);
                matrix(format!("{lp}.linear_attn.in_proj_b.weight"), &g.in_proj_b);
                matrix(format!("{lp}.linear_attn.in_proj_a.weight"), &g.in_proj_a);
                matrix(format!("{lp}.linear_attn.out_proj.weight"), &g.out_proj);
            }
            Mixer::Full(a) => {
                matrix(format!("{lp}.self_attn.q_proj.weight"), &a.q_proj);
                matrix(format!("{lp}.self_attn.k_proj.weight"), &a.k_proj);
                matrix(format!("{lp}.self_attn.v_proj.weight"), &a.v_proj);
                matrix(format!("{lp}.self_attn.o_proj.weight"), &a.o_proj);
            }
        }
        let m = &layer.moe;
        matrix(format!("{lp}.mlp.gate.weight"), &m.router);
        matrix(format!("{lp}.mlp.shared_expert.gate_proj.weight"), &m.shared_gate);
        matrix(format!("{lp}.mlp.shared_expert.up_proj.weight"), &m.shared_up);
        matrix(format!("{lp}.mlp.shared_expert.down_proj.weight"), &m.shared_down);
        matrix(format!("{lp}.mlp.shared_expert_gate.weight"), &m.shared_expert_gate);
        let (e, i, h) = (c.num_experts, c.moe_intermediate_size, c.hidden_size);
        let (gate, up) = (dequantized(&m.experts_gate), dequantized(&m.experts_up));
        let mut gate_up = Vec::with_capacity(2 * gate.len());
        for x in 0..e {
            gate_up.extend_from_slice(&gate[x * i * h..(x + 1) * i * h]);
            gate_up.extend_from_slice(&up[x * i * h..(x + 1) * i * h]);
        }
        matrix_shaped(format!("{lp}.mlp.experts.gate_up_proj"), vec![e, 2 * i, h], gate_up);
        matrix_shaped(
            format!("{lp}.mlp.experts.down_proj"),
            vec![e, h, i],
            dequantized(&m.experts_down),
        );
    }
    let mut floats: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
    let offset = |v: &[f32]| v.iter().map(|x| x - 1.0).collect::<Vec<_>>();
    floats.push((
        format!("{p}.norm.weight"),
        vec![c.hidden_size],
        offset(&weights.final_norm),
    ));
    for (l, layer) in weights.layers.iter().enumerate() {
        let lp = format!("{p}.layers.{l}");
        floats.push((
            format!("{lp}.input_layernorm.weight"),
            vec![c.hidden_size],
            offset(&layer.input_layernorm),
        ));
        floats.push((
            format!("{lp}.post_attention_layernorm.weight"),
            vec![c.hidden_size],
            offset(&layer.post_attention_layernorm),
        ));
        match &layer.mixer {
            Mixer::Linear(g) => {
                floats.push((
                    format!("{lp}.linear_attn.conv1d.weight"),
                    vec![c.linear_conv_dim(), 1, c.linear_conv_kernel_dim],
                    g.conv1d.clone(),
                ));
                floats.push((format!("{lp}.linear_attn.A_log"), vec![g.a_log.len()], g.a_log.clone()));
                floats.push((
                    format!("{lp}.linear_attn.dt_bias"),
                    vec![g.dt_bias.len()],
                    g.dt_bias.clone(),
                ));
                floats.push((
                    format!("{lp}.linear_attn.norm.weight"),
                    vec![g.norm.len()],
                    g.norm.clone(),
                ));
            }
            Mixer::Full(a) => {
                floats.push((
                    format!("{lp}.self_attn.q_norm.weight"),
                    vec![c.head_dim],
                    offset(&a.q_norm),
                ));
                floats.push((
                    format!("{lp}.self_attn.k_norm.weight"),
                    vec![c.head_dim],
                    offset(&a.k_norm),
                ));
            }
        }
    }
    // A_log is f32 in HF checkpoints; everything else bf16.
    let encoded: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = tensors
        .into_inner()
        .into_iter()
        .chain(floats)
        .map(|(name, shape, values)| {
            if name.ends_with("A_log") {
                (
                    name,
                    Dtype::F32,
                    shape,
                    values.iter().flat_map(|v| v.to_le_bytes()).collect(),
                )
            } else {
                (
                    name,
                    Dtype::BF16,
                    shape,
                    values.iter().flat_map(|v| bf16::from_f32(*v).to_le_bytes()).collect(),
                )
            }
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView)> = encoded
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    std::fs::create_dir_all(dir).unwrap();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    let mut hf_config = c.to_mlx_json();
    let obj = hf_config.as_object_mut().unwrap();
    obj.remove("quantization");
    obj.remove("quantization_config");
    std::fs::write(dir.join("config.json"), hf_config.to_string()).unwrap();
}

/// An HF bf16 checkpoint of the default model, quantized at load, runs through the same kernels and predicts
/// nearly the same distribution as the MLX original (re-quantizing the dequantized weights costs a little).
#[test]
fn hf_bf16_checkpoint_is_quantized_at_load() {
    let mlx_dir = lily_model::default_model::locate().unwrap();
    let mlx = Weights::load(&mlx_dir).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let hf_dir = tmp.path().join("hf");
    write_hf(&mlx, &hf_dir);
    let hf = Weights::load(&hf_dir).unwrap();
    assert!(hf.config.quantization.is_none());

    // Per matrix: every re-quantized weight within half a quantization step (plus bf16 rounding) of the original.
    let pairs = [
        (&mlx.layers[0].moe.experts_down, &hf.layers[0].moe.experts_down),
        (&mlx.lm_head, &hf.lm_head),
    ];
    for (a, b) in pairs {
        let (da, db) = (dequantized(a), dequantized(b));
        let scales = b.scales.as_slice();
        for (k, (x, y)) in da.iter().zip(&db).enumerate() {
            let step = scales[k / 64].to_f32();
            assert!(
                (x - y).abs() <= 0.5 * step + 0.01 * x.abs() + 1e-6,
                "element {k}: {x} vs {y} (step {step})"
            );
        }
    }

    let (mlx_model, hf_model) = (CpuModel::new(mlx), CpuModel::new(hf));
    let prompt = [33, 1960, 1321, 13, 198, 3034, 374, 264, 1296, 11];
    let vocab = mlx_model.config().vocab_size;
    let (mut a, mut b) = (vec![0.0; vocab], vec![0.0; vocab]);
    mlx_model
        .prefill(&mut mlx_model.new_state(16), &prompt, &mut a)
        .unwrap();
    hf_model.prefill(&mut hf_model.new_state(16), &prompt, &mut b).unwrap();
    let dot: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let na: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    let cosine = dot / (na * nb);
    assert!(cosine > 0.99, "logit cosine similarity {cosine}");
    assert_eq!(lily_model::sampling::argmax(&a), lily_model::sampling::argmax(&b));
}

#[test]
fn errors_are_typed() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = write_tiny(tmp.path());
    rewrite_tensor(&dir, SCALES, |_, _, _| None);
    assert!(matches!(Weights::load(&dir), Err(CheckpointError::Missing { .. })));
}
