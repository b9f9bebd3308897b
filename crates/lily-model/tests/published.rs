//! Checkpoints in every published layout (the HF release with its vision tower and MTP layer, an HF per-expert
//! re-save, mlx-lm's and mlx-vlm's 4-bit conversions, an mlx-community bf16 conversion), written by
//! `synth::write_published` with the releases' names, dtypes, shapes and config.json layouts, all holding the same
//! model on the 4-bit grid: each loads to the same weights, bit for bit, and gives the same logits.

use std::path::Path;

use lily_model::cpu::CpuModel;
use lily_model::quant::QMatrix;
use lily_model::synth::{write_published, Published};
use lily_model::weights::{Layout, Mixer};
use lily_model::{Config, Weights};

/// A small model of the real structure: 3 Gated DeltaNet layers then a full-attention layer, 8 experts.
fn fixture_config() -> Config {
    let mut c = Config::tiny_shape();
    c.vocab_size = 4096;
    c.num_hidden_layers = 4;
    c.layer_types.truncate(4);
    c.num_experts = 8;
    c.num_experts_per_tok = 4;
    c.moe_intermediate_size = 128;
    c.shared_expert_intermediate_size = 128;
    c
}

fn write(dir: &Path, layout: Published) -> std::path::PathBuf {
    let out = dir.join(format!("{layout:?}"));
    write_published(&fixture_config(), 5, layout, &out).unwrap();
    out
}

fn same_matrix(name: &str, a: &QMatrix, b: &QMatrix) {
    assert_eq!((a.rows, a.cols, a.bits), (b.rows, b.cols, b.bits), "{name}");
    assert!(
        a.packed.as_slice() == b.packed.as_slice(),
        "{name}: packed values differ"
    );
    assert!(a.scales.as_slice() == b.scales.as_slice(), "{name}: scales differ");
    assert!(a.biases.as_slice() == b.biases.as_slice(), "{name}: biases differ");
}

fn same_weights(layout: Published, a: &Weights, b: &Weights) {
    let tag = |what: &str| format!("{layout:?}: {what}");
    same_matrix(&tag("embed_tokens"), &a.embed_tokens, &b.embed_tokens);
    same_matrix(&tag("lm_head"), &a.lm_head, &b.lm_head);
    assert_eq!(a.final_norm, b.final_norm, "{}", tag("final norm"));
    for (l, (x, y)) in a.layers.iter().zip(&b.layers).enumerate() {
        let t = |what: &str| tag(&format!("layer {l} {what}"));
        assert_eq!(x.input_layernorm, y.input_layernorm, "{}", t("input norm"));
        assert_eq!(
            x.post_attention_layernorm,
            y.post_attention_layernorm,
            "{}",
            t("post-attention norm")
        );
        match (&x.mixer, &y.mixer) {
            (Mixer::Linear(p), Mixer::Linear(q)) => {
                same_matrix(&t("in_proj_qkv"), &p.in_proj_qkv, &q.in_proj_qkv);
                same_matrix(&t("in_proj_z"), &p.in_proj_z, &q.in_proj_z);
                same_matrix(&t("in_proj_a"), &p.in_proj_a, &q.in_proj_a);
                same_matrix(&t("in_proj_b"), &p.in_proj_b, &q.in_proj_b);
                same_matrix(&t("out_proj"), &p.out_proj, &q.out_proj);
                assert_eq!(p.conv1d, q.conv1d, "{}", t("conv1d"));
                assert_eq!(p.a_log, q.a_log, "{}", t("A_log"));
                assert_eq!(p.dt_bias, q.dt_bias, "{}", t("dt_bias"));
                assert_eq!(p.norm, q.norm, "{}", t("gated norm"));
            }
            (Mixer::Full(p), Mixer::Full(q)) => {
                same_matrix(&t("q_proj"), &p.q_proj, &q.q_proj);
                same_matrix(&t("k_proj"), &p.k_proj, &q.k_proj);
                same_matrix(&t("v_proj"), &p.v_proj, &q.v_proj);
                same_matrix(&t("o_proj"), &p.o_proj, &q.o_proj);
                assert_eq!(p.q_norm, q.q_norm, "{}", t("q_norm"));
                assert_eq!(p.k_norm, q.k_norm, "{}", t("k_norm"));
            }
            _ => panic!("{}", t("mixer kinds differ")),
        }
        let (p, q) = (&x.moe, &y.moe);
        same_matrix(&t("router"), &p.router, &q.router);
        same_matrix(&t("experts gate"), &p.experts_gate, &q.experts_gate);
        same_matrix(&t("experts up"), &p.experts_up, &q.experts_up);
        same_matrix(&t("experts down"), &p.experts_down, &q.experts_down);
        same_matrix(&t("shared gate"), &p.shared_gate, &q.shared_gate);
        same_matrix(&t("shared up"), &p.shared_up, &q.shared_up);
        same_matrix(&t("shared down"), &p.shared_down, &q.shared_down);
        same_matrix(&t("shared expert gate"), &p.shared_expert_gate, &q.shared_expert_gate);
    }
}

fn logits(weights: Weights) -> Vec<f32> {
    let model = CpuModel::new(weights);
    let prompt = [760, 3841, 13, 198, 2001, 45, 4095, 7, 300, 12];
    model.prefill_all_logits(&mut model.new_state(16), &prompt).unwrap()
}

#[test]
fn every_published_layout_loads_to_the_same_weights_and_logits() {
    let tmp = tempfile::tempdir().unwrap();
    let reference_dir = write(tmp.path(), Published::MlxLm);
    let reference = Weights::load(&reference_dir).unwrap();
    assert_eq!(reference.report.layout, Some(Layout::Mlx { quantized: true }));
    let reference_logits = logits(Weights::load(&reference_dir).unwrap());
    assert!(reference_logits.iter().all(|l| l.is_finite()));
    assert!(reference_logits.iter().any(|l| *l != 0.0));

    for layout in Published::ALL {
        let dir = if layout == Published::MlxLm {
            reference_dir.clone()
        } else {
            write(tmp.path(), layout)
        };
        let weights = Weights::load(&dir).unwrap_or_else(|e| panic!("{layout:?}: {e}"));
        let report = &weights.report;
        // Every layout names `<|im_end|>` somewhere other than text_config, which has `<|endoftext|>` only.
        assert!(
            weights.config.eos_token_ids.contains(&248046) && weights.config.eos_token_ids.contains(&248044),
            "{layout:?}: {:?}",
            weights.config.eos_token_ids
        );
        assert!(
            report.unused_unknown.is_empty(),
            "{layout:?}: {:?}",
            report.unused_unknown
        );
        assert!(
            report.norm_warnings.is_empty(),
            "{layout:?}: {:?}",
            report.norm_warnings
        );
        let (vision, mtp) = match layout {
            Published::HfRelease => (3, 5),
            Published::MlxVlm => (2, 0),
            _ => (0, 0),
        };
        assert_eq!((report.unused_vision, report.unused_mtp), (vision, mtp), "{layout:?}");
        let expected_layout = match layout {
            Published::HfRelease | Published::HfPerExpert => Layout::Hf { text_only: false },
            Published::MlxLm | Published::MlxVlm => Layout::Mlx { quantized: true },
            Published::MlxBf16 => Layout::Mlx { quantized: false },
        };
        assert_eq!(report.layout, Some(expected_layout));
        same_weights(layout, &reference, &weights);
        assert!(logits(weights) == reference_logits, "{layout:?}: logits differ");
    }
}

#[test]
fn mlx_vlm_tensors_are_unaligned_and_stay_in_the_map_until_read() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = write(tmp.path(), Published::MlxVlm);
    let weights = Weights::load(&dir).unwrap();
    let mut matrices = weights.layers.iter().flat_map(|l| {
        [
            &l.moe.experts_gate,
            &l.moe.experts_up,
            &l.moe.experts_down,
            &l.moe.router,
        ]
    });
    // The writer gives the header an odd length, the worst case MLX's unpadded headers give.
    assert!(
        matrices.all(|m| !m.packed.is_aligned() && !m.scales.is_aligned()),
        "the odd-length header should leave every tensor's data unaligned"
    );
    // Loading copied nothing: every matrix still reads its bytes from the map.
    for m in weights
        .layers
        .iter()
        .flat_map(|l| [&l.moe.experts_gate, &l.moe.experts_down])
    {
        match &m.packed {
            lily_model::quant::Blob::Mapped { copy, .. } => assert!(copy.get().is_none()),
            lily_model::quant::Blob::Owned(_) => panic!("an MLX matrix was copied at load"),
        }
    }
}

#[test]
fn norms_in_the_other_layouts_convention_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = write(tmp.path(), Published::MlxBf16);
    // An MLX checkpoint whose norms were stored as HF offsets (w, near 0): the final norm rewritten so.
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let name = "language_model.model.norm.weight";
    let mut tensors: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect();
    for t in &mut tensors {
        if t.0 == name {
            t.3 =
                t.3.chunks_exact(2)
                    .flat_map(|c| {
                        let v = half::bf16::from_le_bytes([c[0], c[1]]).to_f32() - 1.0;
                        half::bf16::from_f32(v).to_le_bytes()
                    })
                    .collect();
        }
    }
    let views: Vec<_> = tensors
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    drop(st);
    safetensors::serialize_to_file(views, None, &path).unwrap();
    let weights = Weights::load(&dir).unwrap();
    assert_eq!(
        weights.report.norm_warnings.len(),
        1,
        "{:?}",
        weights.report.norm_warnings
    );
    assert!(
        weights.report.norm_warnings[0].contains(name) && weights.report.norm_warnings[0].contains("zero-centred"),
        "{:?}",
        weights.report.norm_warnings
    );
}
