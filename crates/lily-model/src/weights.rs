//! The model's weights in lily's layout, and the one table that maps them from checkpoint names (MLX 4-bit and
//! HF bf16). Quantized matrices stay in the checkpoint's memory map; HF weights are quantized at load.

use std::collections::HashSet;
use std::path::Path;
use std::sync::Mutex;

use half::bf16;
use rayon::prelude::*;
use safetensors::Dtype;

use crate::checkpoint::{Checkpoint, CheckpointError, TensorRef};
use crate::config::{Config, LayerKind, GROUP_SIZE};
use crate::quant::{words_per_row, Blob, QMatrix, QMatrixBuilder};

pub struct Weights {
    pub config: Config,
    pub embed_tokens: QMatrix,
    pub layers: Vec<Layer>,
    /// RMSNorm scales are stored as `1 + w` (MLX's convention) for every zero-centred norm.
    pub final_norm: Vec<f32>,
    pub lm_head: QMatrix,
    /// What the load found besides the weights.
    pub report: LoadReport,
}

/// What a load found besides the weights: the layout, the tensors it did not use, and suspicious norms.
#[derive(Clone, Debug, Default)]
pub struct LoadReport {
    pub layout: Option<Layout>,
    /// Tensors of the vision tower (`model.visual.*`, `vision_tower.*`), unused for text.
    pub unused_vision: usize,
    /// Tensors of the multi-token-prediction layer (`mtp.*`), unused by lily's decoding.
    pub unused_mtp: usize,
    /// Unused tensors that are neither.
    pub unused_unknown: Vec<String>,
    /// One line per norm tensor that looks stored in the other layout's convention.
    pub norm_warnings: Vec<String>,
}

enum UnusedKind {
    Vision,
    Mtp,
    Unknown,
}

impl UnusedKind {
    fn of(name: &str) -> UnusedKind {
        let top = name.strip_prefix("model.").unwrap_or(name);
        if top.starts_with("visual.") || top.starts_with("vision_tower.") {
            UnusedKind::Vision
        } else if top.starts_with("mtp.") {
            UnusedKind::Mtp
        } else {
            UnusedKind::Unknown
        }
    }
}

impl LoadReport {
    fn log(&self, dir: &Path) {
        let dir = dir.display();
        if self.unused_vision + self.unused_mtp > 0 {
            tracing::info!(
                "{dir}: {} tensors not used: {} of the vision tower, {} of the MTP layer",
                self.unused_vision + self.unused_mtp,
                self.unused_vision,
                self.unused_mtp
            );
        }
        if !self.unused_unknown.is_empty() {
            const SHOWN: usize = 8;
            let more = self.unused_unknown.len().saturating_sub(SHOWN);
            tracing::warn!(
                "{dir}: {} tensors not used and not known to lily: {}{}",
                self.unused_unknown.len(),
                self.unused_unknown[..self.unused_unknown.len().min(SHOWN)].join(", "),
                if more > 0 {
                    format!(" and {more} more")
                } else {
                    String::new()
                }
            );
        }
        for warning in &self.norm_warnings {
            tracing::warn!("{dir}: {warning}");
        }
    }
}

pub struct Layer {
    pub input_layernorm: Vec<f32>,
    pub mixer: Mixer,
    pub post_attention_layernorm: Vec<f32>,
    pub moe: Moe,
}

// One per layer: the size difference between the variants costs a few hundred bytes in all, not worth a box.
#[allow(clippy::large_enum_variant)]
pub enum Mixer {
    Linear(GatedDeltaNet),
    Full(Attention),
}

pub struct GatedDeltaNet {
    pub in_proj_qkv: QMatrix,
    pub in_proj_z: QMatrix,
    pub in_proj_b: QMatrix,
    pub in_proj_a: QMatrix,
    /// Depthwise conv taps, `[channel][tap]`, tap K-1 multiplies the newest input.
    pub conv1d: Vec<f32>,
    pub a_log: Vec<f32>,
    pub dt_bias: Vec<f32>,
    /// Gated RMSNorm weight, used as is (not `1 + w`).
    pub norm: Vec<f32>,
    pub out_proj: QMatrix,
}

pub struct Attention {
    /// Per head: rows [query 0..head_dim | gate head_dim..2*head_dim].
    pub q_proj: QMatrix,
    pub k_proj: QMatrix,
    pub v_proj: QMatrix,
    pub o_proj: QMatrix,
    pub q_norm: Vec<f32>,
    pub k_norm: Vec<f32>,
}

pub struct Moe {
    /// 8-bit, `[num_experts, hidden]`.
    pub router: QMatrix,
    /// Stacked experts: expert `e` owns rows `e * rows_per_expert ..`.
    pub experts_gate: QMatrix,
    pub experts_up: QMatrix,
    pub experts_down: QMatrix,
    pub shared_gate: QMatrix,
    pub shared_up: QMatrix,
    pub shared_down: QMatrix,
    /// 8-bit, `[1, hidden]`.
    pub shared_expert_gate: QMatrix,
}

/// Where a checkpoint keeps its tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// MLX: `language_model.model.*`, `language_model.lm_head`, experts stacked as `mlp.switch_mlp.*`, norms stored
    /// as `1 + w`. `quantized` is false for a bf16 conversion (no `quantization` block), quantized at load.
    Mlx { quantized: bool },
    /// HF bf16: `model.language_model.*` (or `model.*` for a text-only save), `lm_head.weight`; experts fused as
    /// `mlp.experts.{gate_up,down}_proj` or one module per expert, `mlp.experts.N.{gate,up,down}_proj.weight`.
    Hf { text_only: bool },
}

/// A matrix of the model, named by its module path below `layers.N.` (or at the top), with its MLX and HF names.
/// `hf` is `None` where HF stores it fused (experts) and the loader splits it.
struct MatrixName {
    mlx: &'static str,
    hf: Option<&'static str>,
}

const EMBED: MatrixName = MatrixName {
    mlx: "embed_tokens",
    hf: Some("embed_tokens"),
};
const IN_PROJ_QKV: MatrixName = MatrixName {
    mlx: "linear_attn.in_proj_qkv",
    hf: Some("linear_attn.in_proj_qkv"),
};
const IN_PROJ_Z: MatrixName = MatrixName {
    mlx: "linear_attn.in_proj_z",
    hf: Some("linear_attn.in_proj_z"),
};
const IN_PROJ_B: MatrixName = MatrixName {
    mlx: "linear_attn.in_proj_b",
    hf: Some("linear_attn.in_proj_b"),
};
const IN_PROJ_A: MatrixName = MatrixName {
    mlx: "linear_attn.in_proj_a",
    hf: Some("linear_attn.in_proj_a"),
};
const OUT_PROJ: MatrixName = MatrixName {
    mlx: "linear_attn.out_proj",
    hf: Some("linear_attn.out_proj"),
};
const Q_PROJ: MatrixName = MatrixName {
    mlx: "self_attn.q_proj",
    hf: Some("self_attn.q_proj"),
};
const K_PROJ: MatrixName = MatrixName {
    mlx: "self_attn.k_proj",
    hf: Some("self_attn.k_proj"),
};
const V_PROJ: MatrixName = MatrixName {
    mlx: "self_attn.v_proj",
    hf: Some("self_attn.v_proj"),
};
const O_PROJ: MatrixName = MatrixName {
    mlx: "self_attn.o_proj",
    hf: Some("self_attn.o_proj"),
};
const ROUTER: MatrixName = MatrixName {
    mlx: "mlp.gate",
    hf: Some("mlp.gate"),
};
const EXPERTS_GATE: MatrixName = MatrixName {
    mlx: "mlp.switch_mlp.gate_proj",
    hf: None,
};
const EXPERTS_UP: MatrixName = MatrixName {
    mlx: "mlp.switch_mlp.up_proj",
    hf: None,
};
const EXPERTS_DOWN: MatrixName = MatrixName {
    mlx: "mlp.switch_mlp.down_proj",
    hf: None,
};
const HF_EXPERTS_GATE_UP: &str = "mlp.experts.gate_up_proj";
const HF_EXPERTS_DOWN: &str = "mlp.experts.down_proj";
/// One expert's projection in the per-expert HF layout: `mlp.experts.{N}.{gate,up,down}_proj.weight`.
fn hf_expert(expert: usize, proj: &str) -> String {
    format!("mlp.experts.{expert}.{proj}.weight")
}
const SHARED_GATE: MatrixName = MatrixName {
    mlx: "mlp.shared_expert.gate_proj",
    hf: Some("mlp.shared_expert.gate_proj"),
};
const SHARED_UP: MatrixName = MatrixName {
    mlx: "mlp.shared_expert.up_proj",
    hf: Some("mlp.shared_expert.up_proj"),
};
const SHARED_DOWN: MatrixName = MatrixName {
    mlx: "mlp.shared_expert.down_proj",
    hf: Some("mlp.shared_expert.down_proj"),
};
const SHARED_EXPERT_GATE: MatrixName = MatrixName {
    mlx: "mlp.shared_expert_gate",
    hf: Some("mlp.shared_expert_gate"),
};
const LM_HEAD: MatrixName = MatrixName {
    mlx: "lm_head",
    hf: Some("lm_head"),
};

/// Small float tensors: the same path in both layouts (with `.weight` where it is a module's weight).
const INPUT_NORM: &str = "input_layernorm.weight";
const POST_ATTENTION_NORM: &str = "post_attention_layernorm.weight";
const CONV1D: &str = "linear_attn.conv1d.weight";
const A_LOG: &str = "linear_attn.A_log";
const DT_BIAS: &str = "linear_attn.dt_bias";
const GATED_NORM: &str = "linear_attn.norm.weight";
const Q_NORM: &str = "self_attn.q_norm.weight";
const K_NORM: &str = "self_attn.k_norm.weight";
const FINAL_NORM: &str = "norm.weight";

struct Loader<'a> {
    ckpt: &'a Checkpoint,
    config: &'a Config,
    layout: Layout,
    /// Every tensor name read so far (layers load in parallel).
    used: Mutex<HashSet<String>>,
    /// Norm tensors whose values look stored in the other layout's convention.
    norm_warnings: Mutex<Vec<String>>,
}

/// Rows quantized at a time when a float matrix is quantized at load: bounds the f32 copy held per thread.
const QUANTIZE_BLOCK_ELEMENTS: usize = 1 << 20;

impl Loader<'_> {
    fn get(&self, name: &str) -> Result<TensorRef<'_>, CheckpointError> {
        let t = self.ckpt.get(name)?;
        self.used.lock().unwrap().insert(name.to_string());
        Ok(t)
    }

    fn quantized(&self) -> bool {
        matches!(self.layout, Layout::Mlx { quantized: true })
    }

    /// Full name of a tensor below the text model (`layer` None for top-level ones, except lm_head).
    fn name(&self, layer: Option<usize>, path: &str) -> String {
        let base = match self.layout {
            Layout::Mlx { .. } => "language_model.model.",
            Layout::Hf { text_only: false } => "model.language_model.",
            Layout::Hf { text_only: true } => "model.",
        };
        match layer {
            Some(l) => format!("{base}layers.{l}.{path}"),
            None => format!("{base}{path}"),
        }
    }

    fn lm_head_module(&self) -> String {
        match self.layout {
            Layout::Mlx { .. } => "language_model.lm_head".to_string(),
            Layout::Hf { .. } => "lm_head".to_string(),
        }
    }

    fn matrix(
        &self,
        layer: Option<usize>,
        name: &MatrixName,
        rows: usize,
        cols: usize,
    ) -> Result<QMatrix, CheckpointError> {
        let module = if name.mlx == LM_HEAD.mlx {
            self.lm_head_module()
        } else {
            match self.layout {
                Layout::Mlx { .. } => self.name(layer, name.mlx),
                Layout::Hf { .. } => self.name(layer, name.hf.expect("fused HF tensors are loaded by experts()")),
            }
        };
        if self.quantized() {
            return self.mlx_matrix(&module, &[rows], cols);
        }
        let t = self.get(&format!("{module}.weight"))?;
        float_shape(&t, &[rows, cols])?;
        let mut builder = QMatrixBuilder::new(rows, cols, unquantized_bits(name));
        let block = (QUANTIZE_BLOCK_ELEMENTS / cols).max(1) * cols;
        let mut start = 0;
        while start < rows * cols {
            let n = block.min(rows * cols - start);
            builder.push_rows(&t.f32_range(start, n)?);
            start += n;
        }
        Ok(builder.finish())
    }

    /// An MLX quantized module: `.weight` u32 `[..outer, packed]`, `.scales`/`.biases` bf16 `[..outer, groups]`.
    fn mlx_matrix(&self, module: &str, outer: &[usize], cols: usize) -> Result<QMatrix, CheckpointError> {
        let spec = self
            .config
            .quantization
            .as_ref()
            .map(|q| q.spec_for(module))
            .expect("MLX layout has quantization");
        let rows: usize = outer.iter().product();
        let shape = |last: usize| outer.iter().copied().chain([last]).collect::<Vec<_>>();
        let weight = self.get(&format!("{module}.weight"))?;
        weight.expect(Dtype::U32, &shape(words_per_row(cols, spec.bits)))?;
        let scales = self.get(&format!("{module}.scales"))?;
        scales.expect(Dtype::BF16, &shape(cols / GROUP_SIZE))?;
        let biases = self.get(&format!("{module}.biases"))?;
        biases.expect(Dtype::BF16, &shape(cols / GROUP_SIZE))?;
        scales.check_finite_bf16()?;
        biases.check_finite_bf16()?;
        Ok(QMatrix {
            rows,
            cols,
            bits: spec.bits,
            packed: Blob::from_map(weight.map, weight.info.start, rows * words_per_row(cols, spec.bits)),
            scales: Blob::from_map(scales.map, scales.info.start, rows * cols / GROUP_SIZE),
            biases: Blob::from_map(biases.map, biases.info.start, rows * cols / GROUP_SIZE),
        })
    }

    /// Quantizes `num_experts` float blocks of `rows x cols` into one stacked 4-bit matrix, one expert at a time;
    /// `part(x)` gives expert `x`'s tensor and the element its block starts at.
    fn stack_experts<'t>(
        &self,
        rows: usize,
        cols: usize,
        part: impl Fn(usize) -> Result<(TensorRef<'t>, usize), CheckpointError>,
    ) -> Result<QMatrix, CheckpointError> {
        // Every expert's tensor is found and its shape checked before the stacked matrix is allocated, so that a
        // config with more experts than the checkpoint holds is an error, not an allocation the files never fill.
        let parts = (0..self.config.num_experts).map(part).collect::<Result<Vec<_>, _>>()?;
        let mut builder = QMatrixBuilder::new(parts.len() * rows, cols, 4);
        for (t, start) in parts {
            builder.push_rows(&t.f32_range(start, rows * cols)?);
        }
        Ok(builder.finish())
    }

    /// Stacked experts (gate, up, down), each `[num_experts * rows, cols]`.
    fn experts(&self, layer: usize) -> Result<(QMatrix, QMatrix, QMatrix), CheckpointError> {
        let c = self.config;
        let (e, i, h) = (c.num_experts, c.moe_intermediate_size, c.hidden_size);
        let name = |path: &str| self.name(Some(layer), path);
        match self.layout {
            Layout::Mlx { quantized: true } => Ok((
                self.mlx_matrix(&name(EXPERTS_GATE.mlx), &[e, i], h)?,
                self.mlx_matrix(&name(EXPERTS_UP.mlx), &[e, i], h)?,
                self.mlx_matrix(&name(EXPERTS_DOWN.mlx), &[e, h], i)?,
            )),
            Layout::Mlx { quantized: false } => {
                let stacked = |path: &str, rows: usize, cols: usize| -> Result<QMatrix, CheckpointError> {
                    let t = self.get(&format!("{}.weight", name(path)))?;
                    float_shape(&t, &[e, rows, cols])?;
                    self.stack_experts(rows, cols, |x| Ok((t, x * rows * cols)))
                };
                Ok((
                    stacked(EXPERTS_GATE.mlx, i, h)?,
                    stacked(EXPERTS_UP.mlx, i, h)?,
                    stacked(EXPERTS_DOWN.mlx, h, i)?,
                ))
            }
            Layout::Hf { .. } if self.ckpt.contains(&name(HF_EXPERTS_GATE_UP)) => {
                let gate_up = self.get(&name(HF_EXPERTS_GATE_UP))?;
                float_shape(&gate_up, &[e, 2 * i, h])?;
                let down = self.get(&name(HF_EXPERTS_DOWN))?;
                float_shape(&down, &[e, h, i])?;
                Ok((
                    self.stack_experts(i, h, |x| Ok((gate_up, x * 2 * i * h)))?,
                    self.stack_experts(i, h, |x| Ok((gate_up, x * 2 * i * h + i * h)))?,
                    self.stack_experts(h, i, |x| Ok((down, x * h * i)))?,
                ))
            }
            Layout::Hf { .. } => {
                let per_expert = |proj: &'static str, rows: usize, cols: usize| {
                    self.stack_experts(rows, cols, move |x| {
                        let t = self.get(&name(&hf_expert(x, proj)))?;
                        float_shape(&t, &[rows, cols])?;
                        Ok((t, 0))
                    })
                };
                Ok((
                    per_expert("gate_proj", i, h)?,
                    per_expert("up_proj", i, h)?,
                    per_expert("down_proj", h, i)?,
                ))
            }
        }
    }

    fn floats(&self, layer: Option<usize>, path: &str, len: usize) -> Result<Vec<f32>, CheckpointError> {
        self.get(&self.name(layer, path))?.to_f32(len)
    }

    /// A zero-centred RMSNorm scale, returned as `1 + w` whatever the checkpoint stores.
    ///
    /// MLX stores `1 + w` (values near 1), HF stores `w` (values near 0). A norm whose mean lies nearer the other
    /// convention's is noted: conversions that shifted the weights twice, or not at all, load without error but
    /// compute garbage.
    fn norm(&self, layer: Option<usize>, path: &str, len: usize) -> Result<Vec<f32>, CheckpointError> {
        let mut w = self.floats(layer, path, len)?;
        let mean = w.iter().map(|v| *v as f64).sum::<f64>() / len as f64;
        let hf = matches!(self.layout, Layout::Hf { .. });
        if hf == (mean > 0.5) {
            let (found, expected) = if hf {
                ("one-centred (the MLX convention, 1 + w)", "offsets w near 0")
            } else {
                ("zero-centred (the HF convention, w)", "1 + w near 1")
            };
            self.norm_warnings.lock().unwrap().push(format!(
                "`{}` looks {found}: mean {mean:.3}, where this layout stores {expected}",
                self.name(layer, path)
            ));
        }
        if hf {
            w.iter_mut().for_each(|v| *v += 1.0);
        }
        Ok(w)
    }

    fn conv1d(&self, layer: usize) -> Result<Vec<f32>, CheckpointError> {
        let c = self.config;
        let (channels, taps) = (c.linear_conv_dim(), c.linear_conv_kernel_dim);
        let t = self.get(&self.name(Some(layer), CONV1D))?;
        let expected = match self.layout {
            Layout::Mlx { .. } => [channels, taps, 1],
            Layout::Hf { .. } => [channels, 1, taps],
        };
        if t.info.shape != expected {
            return Err(t.error(format!("expected shape {expected:?}, found {:?}", t.info.shape)));
        }
        // Both layouts hold the taps of a channel contiguously.
        t.to_f32(channels * taps)
    }

    fn layer(&self, l: usize) -> Result<Layer, CheckpointError> {
        let c = self.config;
        let h = c.hidden_size;
        let mixer = match c.layer_types[l] {
            LayerKind::Linear => Mixer::Linear(GatedDeltaNet {
                in_proj_qkv: self.matrix(Some(l), &IN_PROJ_QKV, c.linear_conv_dim(), h)?,
                in_proj_z: self.matrix(Some(l), &IN_PROJ_Z, c.linear_value_dim(), h)?,
                in_proj_b: self.matrix(Some(l), &IN_PROJ_B, c.linear_num_value_heads, h)?,
                in_proj_a: self.matrix(Some(l), &IN_PROJ_A, c.linear_num_value_heads, h)?,
                conv1d: self.conv1d(l)?,
                a_log: self.floats(Some(l), A_LOG, c.linear_num_value_heads)?,
                dt_bias: self.floats(Some(l), DT_BIAS, c.linear_num_value_heads)?,
                norm: self.floats(Some(l), GATED_NORM, c.linear_value_head_dim)?,
                out_proj: self.matrix(Some(l), &OUT_PROJ, h, c.linear_value_dim())?,
            }),
            LayerKind::Full => Mixer::Full(Attention {
                q_proj: self.matrix(Some(l), &Q_PROJ, 2 * c.q_dim(), h)?,
                k_proj: self.matrix(Some(l), &K_PROJ, c.kv_dim(), h)?,
                v_proj: self.matrix(Some(l), &V_PROJ, c.kv_dim(), h)?,
                o_proj: self.matrix(Some(l), &O_PROJ, h, c.q_dim())?,
                q_norm: self.norm(Some(l), Q_NORM, c.head_dim)?,
                k_norm: self.norm(Some(l), K_NORM, c.head_dim)?,
            }),
        };
        let (experts_gate, experts_up, experts_down) = self.experts(l)?;
        let moe = Moe {
            router: self.matrix(Some(l), &ROUTER, c.num_experts, h)?,
            experts_gate,
            experts_up,
            experts_down,
            shared_gate: self.matrix(Some(l), &SHARED_GATE, c.shared_expert_intermediate_size, h)?,
            shared_up: self.matrix(Some(l), &SHARED_UP, c.shared_expert_intermediate_size, h)?,
            shared_down: self.matrix(Some(l), &SHARED_DOWN, h, c.shared_expert_intermediate_size)?,
            shared_expert_gate: self.matrix(Some(l), &SHARED_EXPERT_GATE, 1, h)?,
        };
        Ok(Layer {
            input_layernorm: self.norm(Some(l), INPUT_NORM, h)?,
            mixer,
            post_attention_layernorm: self.norm(Some(l), POST_ATTENTION_NORM, h)?,
            moe,
        })
    }
}

/// A float checkpoint is quantized as MLX quantizes: the router and the shared-expert gate to 8 bits, everything
/// else to 4.
fn unquantized_bits(name: &MatrixName) -> u32 {
    if name.mlx == ROUTER.mlx || name.mlx == SHARED_EXPERT_GATE.mlx {
        8
    } else {
        4
    }
}

/// Checks a float tensor's shape and dtype before it is read in blocks.
fn float_shape(t: &TensorRef, shape: &[usize]) -> Result<(), CheckpointError> {
    if t.info.shape != shape {
        return Err(t.error(format!("expected shape {shape:?}, found {:?}", t.info.shape)));
    }
    if !matches!(t.info.dtype, Dtype::BF16 | Dtype::F16 | Dtype::F32) {
        return Err(t.error(format!("expected BF16, F16 or F32, found {:?}", t.info.dtype)));
    }
    Ok(())
}

impl Weights {
    pub fn load(dir: &Path) -> Result<Weights, CheckpointError> {
        let config = Config::from_dir(dir)?;
        let ckpt = Checkpoint::open(dir)?;
        Weights::from_checkpoint(config, &ckpt)
    }

    pub fn from_checkpoint(config: Config, ckpt: &Checkpoint) -> Result<Weights, CheckpointError> {
        let layout = if ckpt.contains("language_model.model.embed_tokens.weight") {
            Layout::Mlx {
                quantized: config.quantization.is_some(),
            }
        } else if ckpt.contains("model.language_model.embed_tokens.weight") {
            Layout::Hf { text_only: false }
        } else if ckpt.contains("model.embed_tokens.weight") {
            Layout::Hf { text_only: true }
        } else {
            return Err(CheckpointError::Missing {
                dir: ckpt.dir.clone(),
                tensor:
                    "language_model.model.embed_tokens.weight (MLX) or model.language_model.embed_tokens.weight (HF)"
                        .into(),
            });
        };
        let loader = Loader {
            ckpt,
            config: &config,
            layout,
            used: Mutex::new(HashSet::new()),
            norm_warnings: Mutex::new(Vec::new()),
        };
        let c = &config;
        let layers = (0..c.num_hidden_layers)
            .into_par_iter()
            .map(|l| loader.layer(l))
            .collect::<Result<Vec<_>, _>>()?;
        let embed_tokens = loader.matrix(None, &EMBED, c.vocab_size, c.hidden_size)?;
        let final_norm = loader.norm(None, FINAL_NORM, c.hidden_size)?;
        let lm_head = loader.matrix(None, &LM_HEAD, c.vocab_size, c.hidden_size)?;
        let used = loader.used.into_inner().unwrap();
        let mut report = LoadReport {
            layout: Some(layout),
            norm_warnings: loader.norm_warnings.into_inner().unwrap(),
            ..LoadReport::default()
        };
        report.norm_warnings.sort();
        for name in ckpt.names().filter(|name| !used.contains(*name)) {
            match UnusedKind::of(name) {
                UnusedKind::Vision => report.unused_vision += 1,
                UnusedKind::Mtp => report.unused_mtp += 1,
                UnusedKind::Unknown => report.unused_unknown.push(name.to_string()),
            }
        }
        report.unused_unknown.sort();
        report.log(&ckpt.dir);
        Ok(Weights {
            embed_tokens,
            final_norm,
            lm_head,
            layers,
            config,
            report,
        })
    }

    /// Bytes of weight data (quantized values, scales and biases, plus float tensors).
    pub fn bytes(&self) -> usize {
        fn q(m: &QMatrix) -> usize {
            m.packed.as_bytes().len() + m.scales.as_bytes().len() + m.biases.as_bytes().len()
        }
        let mut total = q(&self.embed_tokens) + q(&self.lm_head) + self.final_norm.len() * 4;
        for layer in &self.layers {
            total += (layer.input_layernorm.len() + layer.post_attention_layernorm.len()) * 4;
            total += match &layer.mixer {
                Mixer::Linear(g) => {
                    q(&g.in_proj_qkv)
                        + q(&g.in_proj_z)
                        + q(&g.in_proj_a)
                        + q(&g.in_proj_b)
                        + q(&g.out_proj)
                        + (g.conv1d.len() + g.a_log.len() + g.dt_bias.len() + g.norm.len()) * 4
                }
                Mixer::Full(a) => {
                    q(&a.q_proj) + q(&a.k_proj) + q(&a.v_proj) + q(&a.o_proj) + (a.q_norm.len() + a.k_norm.len()) * 4
                }
            };
            let m = &layer.moe;
            total += [
                &m.router,
                &m.experts_gate,
                &m.experts_up,
                &m.experts_down,
                &m.shared_gate,
                &m.shared_up,
                &m.shared_down,
                &m.shared_expert_gate,
            ]
            .into_iter()
            .map(q)
            .sum::<usize>();
        }
        total
    }
}

/// bf16 helpers used by writers of checkpoints.
pub fn f32_to_bf16_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| bf16::from_f32(*v).to_le_bytes()).collect()
}
