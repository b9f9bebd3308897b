//! The model's weights in lily's layout, and the one table that maps them from checkpoint names (MLX 4-bit and
//! HF bf16). Quantized matrices stay in the checkpoint's memory map; HF weights are quantized at load.

use std::path::Path;

use half::bf16;
use rayon::prelude::*;
use safetensors::Dtype;

use crate::checkpoint::{Checkpoint, CheckpointError, TensorRef};
use crate::config::{Config, LayerKind, GROUP_SIZE};
use crate::quant::{words_per_row, Blob, QMatrix};

pub struct Weights {
    pub config: Config,
    pub embed_tokens: QMatrix,
    pub layers: Vec<Layer>,
    /// RMSNorm scales are stored as `1 + w` (MLX's convention) for every zero-centred norm.
    pub final_norm: Vec<f32>,
    pub lm_head: QMatrix,
}

pub struct Layer {
    pub input_norm: Vec<f32>,
    pub mixer: Mixer,
    pub post_attention_norm: Vec<f32>,
    pub moe: Moe,
}

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
    /// MLX 4-bit: `language_model.model.*`, `language_model.lm_head`.
    Mlx,
    /// HF bf16: `model.language_model.*` (or `model.*` for a text-only save), `lm_head.weight`.
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
}

impl Loader<'_> {
    /// Full name of a tensor below the text model (`layer` None for top-level ones, except lm_head).
    fn name(&self, layer: Option<usize>, path: &str) -> String {
        let base = match self.layout {
            Layout::Mlx => "language_model.model.",
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
            Layout::Mlx => "language_model.lm_head".to_string(),
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
        let module = if name.mlx == "lm_head" {
            self.lm_head_module()
        } else {
            self.name(layer, name.mlx)
        };
        match self.layout {
            Layout::Mlx => self.mlx_matrix(&module, &[rows], cols),
            Layout::Hf { .. } => {
                let module = if name.mlx == "lm_head" {
                    module
                } else {
                    self.name(layer, name.hf.expect("fused HF tensors are loaded by experts()"))
                };
                let t = self.ckpt.get(&format!("{module}.weight"))?;
                let values = hf_values(&t, &[rows, cols])?;
                Ok(QMatrix::quantize(&values, rows, cols, hf_bits(name)))
            }
        }
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
        let weight = self.ckpt.get(&format!("{module}.weight"))?;
        weight.expect(Dtype::U32, &shape(words_per_row(cols, spec.bits)))?;
        let scales = self.ckpt.get(&format!("{module}.scales"))?;
        scales.expect(Dtype::BF16, &shape(cols / GROUP_SIZE))?;
        let biases = self.ckpt.get(&format!("{module}.biases"))?;
        biases.expect(Dtype::BF16, &shape(cols / GROUP_SIZE))?;
        Ok(QMatrix {
            rows,
            cols,
            bits: spec.bits,
            packed: Blob::from_map(weight.map, weight.info.start, rows * words_per_row(cols, spec.bits)),
            scales: Blob::from_map(scales.map, scales.info.start, rows * cols / GROUP_SIZE),
            biases: Blob::from_map(biases.map, biases.info.start, rows * cols / GROUP_SIZE),
        })
    }

    /// Stacked experts (gate, up, down), each `[num_experts * rows, cols]`.
    fn experts(&self, layer: usize) -> Result<(QMatrix, QMatrix, QMatrix), CheckpointError> {
        let c = self.config;
        let (e, i, h) = (c.num_experts, c.moe_intermediate_size, c.hidden_size);
        match self.layout {
            Layout::Mlx => Ok((
                self.mlx_matrix(&self.name(Some(layer), EXPERTS_GATE.mlx), &[e, i], h)?,
                self.mlx_matrix(&self.name(Some(layer), EXPERTS_UP.mlx), &[e, i], h)?,
                self.mlx_matrix(&self.name(Some(layer), EXPERTS_DOWN.mlx), &[e, h], i)?,
            )),
            Layout::Hf { .. } => {
                let gate_up = self.ckpt.get(&self.name(Some(layer), HF_EXPERTS_GATE_UP))?;
                let gate_up = hf_values(&gate_up, &[e, 2 * i, h])?;
                let (mut gate, mut up) = (Vec::with_capacity(e * i * h), Vec::with_capacity(e * i * h));
                for expert in gate_up.chunks_exact(2 * i * h) {
                    gate.extend_from_slice(&expert[..i * h]);
                    up.extend_from_slice(&expert[i * h..]);
                }
                let down = self.ckpt.get(&self.name(Some(layer), HF_EXPERTS_DOWN))?;
                let down = hf_values(&down, &[e, h, i])?;
                Ok((
                    QMatrix::quantize(&gate, e * i, h, 4),
                    QMatrix::quantize(&up, e * i, h, 4),
                    QMatrix::quantize(&down, e * h, i, 4),
                ))
            }
        }
    }

    fn floats(&self, layer: Option<usize>, path: &str, len: usize) -> Result<Vec<f32>, CheckpointError> {
        self.ckpt.get(&self.name(layer, path))?.to_f32(len)
    }

    /// A zero-centred RMSNorm scale, returned as `1 + w` whatever the checkpoint stores.
    fn norm(&self, layer: Option<usize>, path: &str, len: usize) -> Result<Vec<f32>, CheckpointError> {
        let mut w = self.floats(layer, path, len)?;
        if matches!(self.layout, Layout::Hf { .. }) {
            w.iter_mut().for_each(|v| *v += 1.0);
        }
        Ok(w)
    }

    fn conv1d(&self, layer: usize) -> Result<Vec<f32>, CheckpointError> {
        let c = self.config;
        let (channels, taps) = (c.linear_conv_dim(), c.linear_conv_kernel_dim);
        let t = self.ckpt.get(&self.name(Some(layer), CONV1D))?;
        let expected = match self.layout {
            Layout::Mlx => [channels, taps, 1],
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
            input_norm: self.norm(Some(l), INPUT_NORM, h)?,
            mixer,
            post_attention_norm: self.norm(Some(l), POST_ATTENTION_NORM, h)?,
            moe,
        })
    }
}

/// HF quantizes the router and the shared-expert gate to 8 bits (as MLX does), everything else to 4.
fn hf_bits(name: &MatrixName) -> u32 {
    if name.mlx == ROUTER.mlx || name.mlx == SHARED_EXPERT_GATE.mlx {
        8
    } else {
        4
    }
}

fn hf_values(t: &TensorRef, shape: &[usize]) -> Result<Vec<f32>, CheckpointError> {
    if t.info.shape != shape {
        return Err(t.error(format!("expected shape {shape:?}, found {:?}", t.info.shape)));
    }
    if !matches!(t.info.dtype, Dtype::BF16 | Dtype::F16 | Dtype::F32) {
        return Err(t.error(format!("expected BF16, F16 or F32, found {:?}", t.info.dtype)));
    }
    t.to_f32(shape.iter().product())
}

impl Weights {
    pub fn load(dir: &Path) -> Result<Weights, CheckpointError> {
        let config = Config::from_dir(dir)?;
        let ckpt = Checkpoint::open(dir)?;
        Weights::from_checkpoint(config, &ckpt)
    }

    pub fn from_checkpoint(config: Config, ckpt: &Checkpoint) -> Result<Weights, CheckpointError> {
        let layout = if ckpt.contains("language_model.model.embed_tokens.weight") {
            if config.quantization.is_none() {
                return Err(CheckpointError::File {
                    path: ckpt.dir.join("config.json"),
                    message: "MLX tensor names but no `quantization` block in config.json".into(),
                });
            }
            Layout::Mlx
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
        };
        let c = &config;
        let layers = (0..c.num_hidden_layers)
            .into_par_iter()
            .map(|l| loader.layer(l))
            .collect::<Result<Vec<_>, _>>()?;
        let weights = Weights {
            embed_tokens: loader.matrix(None, &EMBED, c.vocab_size, c.hidden_size)?,
            final_norm: loader.norm(None, FINAL_NORM, c.hidden_size)?,
            lm_head: loader.matrix(None, &LM_HEAD, c.vocab_size, c.hidden_size)?,
            layers,
            config,
        };
        Ok(weights)
    }

    /// Bytes of weight data (quantized values, scales and biases, plus float tensors).
    pub fn bytes(&self) -> usize {
        fn q(m: &QMatrix) -> usize {
            m.packed.as_slice().len() * 4 + m.scales.as_slice().len() * 2 * 2
        }
        let mut total = q(&self.embed_tokens) + q(&self.lm_head) + self.final_norm.len() * 4;
        for layer in &self.layers {
            total += (layer.input_norm.len() + layer.post_attention_norm.len()) * 4;
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
