//! The model's weights on the GPU: MLX's packed 4-bit (8-bit for the router) rows as they are, each matrix's
//! scales and biases interleaved into one (scale, bias) bf16 pair per group, and the matrices one launch reads
//! together stacked: a DeltaNet layer's q/k/v, z, b, a projections; an attention layer's q(+gate), k, v; the
//! router and the shared expert's gate. The expert matrices (routed and shared) are then tiled ([`Layout`]). Filled
//! from a checkpoint loaded on the CPU, or generated in place.

use std::collections::HashMap;

use half::bf16;
use lily_model::config::{LayerKind, GROUP_SIZE};
use lily_model::quant::{words_per_row, QMatrix};
use lily_model::synth::{Fill, SynthTensor};
use lily_model::weights::{Mixer, Weights};
use lily_model::Config;
use safetensors::Dtype;

use crate::driver::{DevBuf, Gpu, GpuError, Result};
use crate::kernels::{layout, synth, Kernels, Q4};
use crate::launch::{Dims, Launcher};

pub struct GpuMatrix {
    /// `[rows][words per row]`: the packed codes (in `layout`'s order).
    pub packed: DevBuf<u32>,
    /// `[rows][cols / group]`: each group's (scale, bias) bf16 pair, scale in the low half (in `layout`'s order).
    pub scale_bias: DevBuf<u32>,
    pub rows: usize,
    pub cols: usize,
    pub bits: u32,
    pub layout: Layout,
}

/// The order of a matrix's words on the GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// Row after row, as the checkpoint has them.
    Rows,
    /// The expert matrices' order (kernels/common.cuh): rows in blocks of [`TILED_ROWS`]; within a block, piece
    /// after piece of [`TILED_PIECE`] inputs, and within a piece, the block's rows in order. A product that reads
    /// a piece of 128 rows then reads one contiguous run instead of 64 bytes from each row.
    Tiled,
}

/// Rows of a tiled block and inputs of a piece (common.cuh's TILED_ROWS and TILED_PIECE; checked at tiling).
pub const TILED_ROWS: usize = 128;
pub const TILED_PIECE: usize = 128;

/// Where word `word` of row `row` (of rows of `row_words` words, `piece_words` of them a piece) lies once tiled.
pub fn tiled_index(row: usize, word: usize, row_words: usize, piece_words: usize) -> usize {
    (row / TILED_ROWS) * TILED_ROWS * row_words
        + (word / piece_words) * TILED_ROWS * piece_words
        + (row % TILED_ROWS) * piece_words
        + word % piece_words
}

/// `words` (rows of `row_words` words) tiled: the CPU twin of the `tile_rows` kernel.
pub fn tile_words(words: &[u32], row_words: usize, piece_words: usize) -> Vec<u32> {
    let mut out = vec![0; words.len()];
    for (i, &w) in words.iter().enumerate() {
        out[tiled_index(i / row_words, i % row_words, row_words, piece_words)] = w;
    }
    out
}

impl GpuMatrix {
    /// A row-major matrix of that shape, its values not set.
    pub fn alloc(gpu: &Gpu, rows: usize, cols: usize, bits: u32) -> Result<GpuMatrix> {
        Ok(GpuMatrix {
            packed: gpu.alloc(rows * words_per_row(cols, bits))?,
            scale_bias: gpu.alloc(rows * cols / GROUP_SIZE)?,
            rows,
            cols,
            bits,
            layout: Layout::Rows,
        })
    }

    /// The matrix tiled on the GPU (a 4-bit matrix of whole blocks of whole pieces), its row-major buffers freed.
    pub fn tiled(self, gpu: &Gpu, kernels: &Kernels) -> Result<GpuMatrix> {
        assert_eq!(self.layout, Layout::Rows, "a matrix is tiled once");
        if kernels.constant("tiled_rows") != TILED_ROWS || kernels.constant("tiled_piece") != TILED_PIECE {
            return Err(GpuError::Other("the kernels' tiled layout is not weights.rs's".into()));
        }
        if self.bits != 4 || !self.rows.is_multiple_of(TILED_ROWS) || !self.cols.is_multiple_of(TILED_PIECE) {
            return Err(GpuError::Other(format!(
                "a {}x{} {}-bit matrix cannot be tiled in blocks of {TILED_ROWS} rows and pieces of {TILED_PIECE}",
                self.rows, self.cols, self.bits
            )));
        }
        let tiled = GpuMatrix {
            layout: Layout::Tiled,
            ..GpuMatrix::alloc(gpu, self.rows, self.cols, self.bits)?
        };
        let pieces = self.cols / TILED_PIECE;
        let mut l = Launcher::new(gpu, kernels);
        for (src, dst, row_words) in [
            (&self.packed, &tiled.packed, self.row_words()),
            (&self.scale_bias, &tiled.scale_bias, self.cols / GROUP_SIZE),
        ] {
            let dims = Dims::linear((self.rows * row_words).div_ceil(256).min(65536) as u32, 256);
            let piece_words = (row_words / pieces) as i32;
            layout::tile_rows(
                &mut l,
                dims,
                src.ptr(),
                dst.ptr(),
                self.rows as u64,
                row_words as i32,
                piece_words,
            )?;
        }
        // The row-major buffers are freed when this returns: the copies must be done.
        gpu.sync()?;
        Ok(tiled)
    }

    fn row_words(&self) -> usize {
        words_per_row(self.cols, self.bits)
    }
    /// Bytes of one row (packed values plus its scales and biases).
    pub fn bytes_per_row(&self) -> usize {
        (self.row_words() + self.cols / GROUP_SIZE) * 4
    }
    pub fn bytes(&self) -> usize {
        self.rows * self.bytes_per_row()
    }
    /// The `Q4` argument of the kernels that read a tiled matrix (the expert kernels); panics on a row-major one,
    /// which they would read as garbage.
    pub fn tiled_q4(&self) -> Q4 {
        assert_eq!(self.layout, Layout::Tiled, "the expert kernels read tiled matrices");
        self.q4()
    }
    /// The kernels' `Q4` argument.
    pub fn q4(&self) -> Q4 {
        Q4 {
            packed: self.packed.ptr(),
            scale_bias: self.scale_bias.ptr(),
        }
    }
}

/// A CPU matrix on the GPU, row-major (packed rows as they are, scale and bias paired); [`GpuMatrix::tiled`] makes
/// an expert matrix of it.
pub fn upload(gpu: &Gpu, m: &QMatrix) -> Result<GpuMatrix> {
    let dest = GpuMatrix::alloc(gpu, m.rows, m.cols, m.bits)?;
    gpu.upload(dest.packed.ptr().cast::<u8>(), m.packed.as_bytes())?;
    gpu.upload(dest.scale_bias.ptr(), &scale_bias_pairs(m))?;
    Ok(dest)
}

/// Each group's (scale, bias) bf16 pair as one word, read from the checkpoint's bytes: a matrix mapped unaligned
/// is uploaded from the map without an aligned host copy.
fn scale_bias_pairs(m: &QMatrix) -> Vec<u32> {
    let bits = |pair: &[u8]| u16::from_le_bytes([pair[0], pair[1]]) as u32;
    m.scales
        .as_bytes()
        .chunks_exact(2)
        .zip(m.biases.as_bytes().chunks_exact(2))
        .map(|(s, b)| bits(s) | bits(b) << 16)
        .collect()
}

pub struct GpuGatedDeltaNet {
    /// Rows: q k v (conv channels), z, b, a.
    pub in_proj: GpuMatrix,
    /// `[channel][tap]`, f32.
    pub conv1d: DevBuf<f32>,
    pub a_log: DevBuf<f32>,
    pub dt_bias: DevBuf<f32>,
    pub norm: DevBuf<f32>,
    pub out_proj: GpuMatrix,
}

pub struct GpuAttention {
    /// Rows: per head [query | gate], then k, then v.
    pub qkv: GpuMatrix,
    pub q_norm: DevBuf<f32>,
    pub k_norm: DevBuf<f32>,
    pub o_proj: GpuMatrix,
}

pub enum GpuMixer {
    Linear(GpuGatedDeltaNet),
    Full(GpuAttention),
}

impl GpuMixer {
    /// The product that takes the layer's normed input: the DeltaNet's in_proj or the attention's qkv.
    pub fn input_projection(&self) -> &GpuMatrix {
        match self {
            GpuMixer::Linear(g) => &g.in_proj,
            GpuMixer::Full(a) => &a.qkv,
        }
    }
}

pub struct GpuLayer {
    pub input_layernorm: DevBuf<f32>,
    pub post_attention_layernorm: DevBuf<f32>,
    pub mixer: GpuMixer,
    /// 8-bit; rows: the experts' router, then the shared expert's gate.
    pub router: GpuMatrix,
    pub experts_gate: GpuMatrix,
    pub experts_up: GpuMatrix,
    pub experts_down: GpuMatrix,
    pub shared_gate: GpuMatrix,
    pub shared_up: GpuMatrix,
    pub shared_down: GpuMatrix,
}

impl GpuLayer {
    /// The matrices of the layer's grouped expert products (the routed experts and the shared one).
    pub fn experts(&self) -> crate::gemm::Experts<'_> {
        crate::gemm::Experts {
            gate: &self.experts_gate,
            up: &self.experts_up,
            down: &self.experts_down,
            shared_gate: &self.shared_gate,
            shared_up: &self.shared_up,
            shared_down: &self.shared_down,
        }
    }
}

pub struct GpuWeights {
    pub embed_tokens: GpuMatrix,
    pub layers: Vec<GpuLayer>,
    pub final_norm: DevBuf<f32>,
    pub lm_head: GpuMatrix,
}

/// Device bytes the quantized matrices of `w` take once uploaded (the float vectors are negligible beside them).
pub fn device_bytes(w: &Weights) -> usize {
    let m = |q: &QMatrix| q.rows * (words_per_row(q.cols, q.bits) + q.cols / GROUP_SIZE) * 4;
    let mut bytes = m(&w.embed_tokens) + m(&w.lm_head);
    for layer in &w.layers {
        bytes += match &layer.mixer {
            Mixer::Linear(g) => [&g.in_proj_qkv, &g.in_proj_z, &g.in_proj_b, &g.in_proj_a, &g.out_proj]
                .into_iter()
                .map(m)
                .sum::<usize>(),
            Mixer::Full(a) => [&a.q_proj, &a.k_proj, &a.v_proj, &a.o_proj].into_iter().map(m).sum(),
        };
        let e = &layer.moe;
        bytes += [
            &e.router,
            &e.shared_expert_gate,
            &e.experts_gate,
            &e.experts_up,
            &e.experts_down,
            &e.shared_gate,
            &e.shared_up,
            &e.shared_down,
        ]
        .into_iter()
        .map(m)
        .sum::<usize>();
    }
    bytes
}

/// A quantized matrix of the model, by its place.
#[derive(Clone, Copy, Debug)]
pub enum Mat {
    Embed,
    LmHead,
    InProjQkv(usize),
    InProjZ(usize),
    InProjB(usize),
    InProjA(usize),
    OutProj(usize),
    QProj(usize),
    KProj(usize),
    VProj(usize),
    OProj(usize),
    Router(usize),
    SharedExpertGate(usize),
    ExpertsGate(usize),
    ExpertsUp(usize),
    ExpertsDown(usize),
    SharedGate(usize),
    SharedUp(usize),
    SharedDown(usize),
}

impl Mat {
    pub fn mlx_name(self) -> String {
        let layer = |l: usize, path: &str| format!("language_model.model.layers.{l}.{path}");
        match self {
            Mat::Embed => "language_model.model.embed_tokens".into(),
            Mat::LmHead => "language_model.lm_head".into(),
            Mat::InProjQkv(l) => layer(l, "linear_attn.in_proj_qkv"),
            Mat::InProjZ(l) => layer(l, "linear_attn.in_proj_z"),
            Mat::InProjB(l) => layer(l, "linear_attn.in_proj_b"),
            Mat::InProjA(l) => layer(l, "linear_attn.in_proj_a"),
            Mat::OutProj(l) => layer(l, "linear_attn.out_proj"),
            Mat::QProj(l) => layer(l, "self_attn.q_proj"),
            Mat::KProj(l) => layer(l, "self_attn.k_proj"),
            Mat::VProj(l) => layer(l, "self_attn.v_proj"),
            Mat::OProj(l) => layer(l, "self_attn.o_proj"),
            Mat::Router(l) => layer(l, "mlp.gate"),
            Mat::SharedExpertGate(l) => layer(l, "mlp.shared_expert_gate"),
            Mat::ExpertsGate(l) => layer(l, "mlp.switch_mlp.gate_proj"),
            Mat::ExpertsUp(l) => layer(l, "mlp.switch_mlp.up_proj"),
            Mat::ExpertsDown(l) => layer(l, "mlp.switch_mlp.down_proj"),
            Mat::SharedGate(l) => layer(l, "mlp.shared_expert.gate_proj"),
            Mat::SharedUp(l) => layer(l, "mlp.shared_expert.up_proj"),
            Mat::SharedDown(l) => layer(l, "mlp.shared_expert.down_proj"),
        }
    }

    fn cpu(self, w: &Weights) -> Option<&QMatrix> {
        let layer = |l: usize| &w.layers[l];
        let deltanet = |l: usize| match &layer(l).mixer {
            Mixer::Linear(g) => Some(g),
            Mixer::Full(_) => None,
        };
        let attn = |l: usize| match &layer(l).mixer {
            Mixer::Full(a) => Some(a),
            Mixer::Linear(_) => None,
        };
        Some(match self {
            Mat::Embed => &w.embed_tokens,
            Mat::LmHead => &w.lm_head,
            Mat::InProjQkv(l) => &deltanet(l)?.in_proj_qkv,
            Mat::InProjZ(l) => &deltanet(l)?.in_proj_z,
            Mat::InProjB(l) => &deltanet(l)?.in_proj_b,
            Mat::InProjA(l) => &deltanet(l)?.in_proj_a,
            Mat::OutProj(l) => &deltanet(l)?.out_proj,
            Mat::QProj(l) => &attn(l)?.q_proj,
            Mat::KProj(l) => &attn(l)?.k_proj,
            Mat::VProj(l) => &attn(l)?.v_proj,
            Mat::OProj(l) => &attn(l)?.o_proj,
            Mat::Router(l) => &layer(l).moe.router,
            Mat::SharedExpertGate(l) => &layer(l).moe.shared_expert_gate,
            Mat::ExpertsGate(l) => &layer(l).moe.experts_gate,
            Mat::ExpertsUp(l) => &layer(l).moe.experts_up,
            Mat::ExpertsDown(l) => &layer(l).moe.experts_down,
            Mat::SharedGate(l) => &layer(l).moe.shared_gate,
            Mat::SharedUp(l) => &layer(l).moe.shared_up,
            Mat::SharedDown(l) => &layer(l).moe.shared_down,
        })
    }
}

/// A float vector of the model, by its place.
#[derive(Clone, Copy, Debug)]
pub enum Vector {
    InputNorm(usize),
    PostNorm(usize),
    Conv(usize),
    ALog(usize),
    DtBias(usize),
    GatedNorm(usize),
    QNorm(usize),
    KNorm(usize),
    FinalNorm,
}

impl Vector {
    fn mlx_name(self) -> String {
        let layer = |l: usize, path: &str| format!("language_model.model.layers.{l}.{path}");
        match self {
            Vector::InputNorm(l) => layer(l, "input_layernorm.weight"),
            Vector::PostNorm(l) => layer(l, "post_attention_layernorm.weight"),
            Vector::Conv(l) => layer(l, "linear_attn.conv1d.weight"),
            Vector::ALog(l) => layer(l, "linear_attn.A_log"),
            Vector::DtBias(l) => layer(l, "linear_attn.dt_bias"),
            Vector::GatedNorm(l) => layer(l, "linear_attn.norm.weight"),
            Vector::QNorm(l) => layer(l, "self_attn.q_norm.weight"),
            Vector::KNorm(l) => layer(l, "self_attn.k_norm.weight"),
            Vector::FinalNorm => "language_model.model.norm.weight".into(),
        }
    }

    fn cpu(self, w: &Weights) -> Option<&[f32]> {
        let layer = |l: usize| &w.layers[l];
        Some(match self {
            Vector::InputNorm(l) => &layer(l).input_layernorm,
            Vector::PostNorm(l) => &layer(l).post_attention_layernorm,
            Vector::FinalNorm => &w.final_norm,
            Vector::Conv(l) | Vector::ALog(l) | Vector::DtBias(l) | Vector::GatedNorm(l) => match &layer(l).mixer {
                Mixer::Linear(g) => match self {
                    Vector::Conv(_) => &g.conv1d,
                    Vector::ALog(_) => &g.a_log,
                    Vector::DtBias(_) => &g.dt_bias,
                    _ => &g.norm,
                },
                Mixer::Full(_) => return None,
            },
            Vector::QNorm(l) | Vector::KNorm(l) => match &layer(l).mixer {
                Mixer::Full(a) => match self {
                    Vector::QNorm(_) => &a.q_norm,
                    _ => &a.k_norm,
                },
                Mixer::Linear(_) => return None,
            },
        })
    }
}

/// Where weights come from.
pub enum Source<'a> {
    /// A checkpoint loaded (memory-mapped) on the CPU.
    Cpu(&'a Weights),
    /// Synthetic weights (lily_model::synth) generated on the GPU; small float vectors are made on the host.
    Synthetic {
        seed: u64,
        tensors: HashMap<String, SynthTensor>,
    },
}

impl Source<'_> {
    pub fn synthetic(config: &Config, seed: u64) -> Source<'static> {
        let tensors = lily_model::synth::tensors(config, seed)
            .into_iter()
            .map(|t| (t.name.clone(), t))
            .collect();
        Source::Synthetic { seed, tensors }
    }

    fn tensor(&self, name: &str) -> Result<&SynthTensor> {
        match self {
            Source::Synthetic { tensors, .. } => tensors
                .get(name)
                .ok_or_else(|| GpuError::Other(format!("synthetic checkpoint has no tensor {name}"))),
            Source::Cpu(_) => unreachable!("only synthetic sources have tensors"),
        }
    }

    /// Writes matrix `id` into rows `row0..` of `dest`.
    fn matrix(&self, gpu: &Gpu, kernels: &Kernels, id: Mat, dest: &GpuMatrix, row0: usize) -> Result<usize> {
        match self {
            Source::Cpu(w) => {
                let m = id
                    .cpu(w)
                    .ok_or_else(|| GpuError::Other(format!("{id:?} is not in this layer")))?;
                if m.cols != dest.cols || m.bits != dest.bits || row0 + m.rows > dest.rows {
                    return Err(GpuError::Other(format!(
                        "{id:?}: {}x{} {}-bit does not fit rows {row0}.. of {}x{} {}-bit",
                        m.rows, m.cols, m.bits, dest.rows, dest.cols, dest.bits
                    )));
                }
                gpu.upload(
                    dest.packed.at(row0 * dest.row_words()).cast::<u8>(),
                    m.packed.as_bytes(),
                )?;
                gpu.upload(dest.scale_bias.at(row0 * dest.cols / GROUP_SIZE), &scale_bias_pairs(m))?;
                Ok(m.rows)
            }
            Source::Synthetic { seed, .. } => {
                let name = id.mlx_name();
                let weight = self.tensor(&format!("{name}.weight"))?;
                let scales = self.tensor(&format!("{name}.scales"))?;
                let rows: usize = weight.shape[..weight.shape.len() - 1].iter().product();
                let words = rows * words_per_row(dest.cols, dest.bits);
                let groups = rows * dest.cols / GROUP_SIZE;
                if weight.shape.iter().product::<usize>() != words || row0 + rows > dest.rows {
                    return Err(GpuError::Other(format!(
                        "{name}: shape {:?} does not fit",
                        weight.shape
                    )));
                }
                let Fill::Scales { base } = scales.fill else {
                    return Err(GpuError::Other(format!("{name}.scales is not a scales tensor")));
                };
                let levels = ((1u32 << dest.bits) - 1) as f32;
                let grid = |n: usize| Dims::linear(n.div_ceil(256).min(65536) as u32, 256);
                let mut l = Launcher::new(gpu, kernels);
                synth::synth_packed(
                    &mut l,
                    grid(words),
                    dest.packed.at(row0 * dest.row_words()),
                    words as u64,
                    *seed,
                    weight.stream,
                )?;
                synth::synth_scale_bias(
                    &mut l,
                    grid(groups),
                    dest.scale_bias.at(row0 * dest.cols / GROUP_SIZE),
                    groups as u64,
                    *seed,
                    scales.stream,
                    base,
                    levels,
                )?;
                Ok(rows)
            }
        }
    }

    fn vector(&self, id: Vector) -> Result<Vec<f32>> {
        match self {
            Source::Cpu(w) => id
                .cpu(w)
                .map(<[f32]>::to_vec)
                .ok_or_else(|| GpuError::Other(format!("{id:?} is not in this layer"))),
            Source::Synthetic { .. } => {
                let t = self.tensor(&id.mlx_name())?;
                let bytes = t.bytes();
                Ok(match t.dtype {
                    Dtype::F32 => bytes
                        .chunks_exact(4)
                        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                        .collect(),
                    Dtype::BF16 => bytes
                        .chunks_exact(2)
                        .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
                        .collect(),
                    other => return Err(GpuError::Other(format!("{}: unexpected dtype {other:?}", t.name))),
                })
            }
        }
    }
}

impl GpuWeights {
    /// Allocates every tensor at the config's shape and fills it from `source`; `progress(done, total)` counts
    /// bytes.
    pub fn load(
        gpu: &Gpu,
        kernels: &Kernels,
        config: &Config,
        source: &Source,
        progress: &dyn Fn(usize, usize),
    ) -> Result<GpuWeights> {
        let c = config;
        let (h, e, i) = (c.hidden_size, c.num_experts, c.moe_intermediate_size);
        let total = lily_model::synth::total_bytes(c);
        let mut done = 0usize;
        let mut fill = |ids: &[Mat], dest: &GpuMatrix| -> Result<()> {
            let mut row = 0;
            for id in ids {
                row += source.matrix(gpu, kernels, *id, dest, row)?;
            }
            if row != dest.rows {
                return Err(GpuError::Other(format!("{ids:?} filled {row} of {} rows", dest.rows)));
            }
            gpu.sync()?;
            done += dest.bytes();
            progress(done.min(total), total);
            Ok(())
        };
        let vector = |id: Vector, len: usize| -> Result<DevBuf<f32>> {
            let values = source.vector(id)?;
            if values.len() != len {
                return Err(GpuError::Other(format!(
                    "{id:?}: {} values, expected {len}",
                    values.len()
                )));
            }
            gpu.upload_new(&values)
        };

        let embed_tokens = GpuMatrix::alloc(gpu, c.vocab_size, h, 4)?;
        fill(&[Mat::Embed], &embed_tokens)?;
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for l in 0..c.num_hidden_layers {
            let mixer = match c.layer_types[l] {
                LayerKind::Linear => {
                    let in_proj = GpuMatrix::alloc(
                        gpu,
                        c.linear_conv_dim() + c.linear_value_dim() + 2 * c.linear_num_value_heads,
                        h,
                        4,
                    )?;
                    fill(
                        &[Mat::InProjQkv(l), Mat::InProjZ(l), Mat::InProjB(l), Mat::InProjA(l)],
                        &in_proj,
                    )?;
                    let out_proj = GpuMatrix::alloc(gpu, h, c.linear_value_dim(), 4)?;
                    fill(&[Mat::OutProj(l)], &out_proj)?;
                    GpuMixer::Linear(GpuGatedDeltaNet {
                        in_proj,
                        conv1d: vector(Vector::Conv(l), c.linear_conv_dim() * c.linear_conv_kernel_dim)?,
                        a_log: vector(Vector::ALog(l), c.linear_num_value_heads)?,
                        dt_bias: vector(Vector::DtBias(l), c.linear_num_value_heads)?,
                        norm: vector(Vector::GatedNorm(l), c.linear_value_head_dim)?,
                        out_proj,
                    })
                }
                LayerKind::Full => {
                    let qkv = GpuMatrix::alloc(gpu, 2 * c.q_dim() + 2 * c.kv_dim(), h, 4)?;
                    fill(&[Mat::QProj(l), Mat::KProj(l), Mat::VProj(l)], &qkv)?;
                    let o_proj = GpuMatrix::alloc(gpu, h, c.q_dim(), 4)?;
                    fill(&[Mat::OProj(l)], &o_proj)?;
                    GpuMixer::Full(GpuAttention {
                        qkv,
                        q_norm: vector(Vector::QNorm(l), c.head_dim)?,
                        k_norm: vector(Vector::KNorm(l), c.head_dim)?,
                        o_proj,
                    })
                }
            };
            let router = GpuMatrix::alloc(gpu, e + 1, h, 8)?;
            fill(&[Mat::Router(l), Mat::SharedExpertGate(l)], &router)?;
            // The expert matrices, routed and shared, tiled.
            let mut expert = |id: Mat, rows: usize, cols: usize| -> Result<GpuMatrix> {
                let m = GpuMatrix::alloc(gpu, rows, cols, 4)?;
                fill(&[id], &m)?;
                m.tiled(gpu, kernels)
            };
            let experts_gate = expert(Mat::ExpertsGate(l), e * i, h)?;
            let experts_up = expert(Mat::ExpertsUp(l), e * i, h)?;
            let experts_down = expert(Mat::ExpertsDown(l), e * h, i)?;
            let si = c.shared_expert_intermediate_size;
            let shared_gate = expert(Mat::SharedGate(l), si, h)?;
            let shared_up = expert(Mat::SharedUp(l), si, h)?;
            let shared_down = expert(Mat::SharedDown(l), h, si)?;
            layers.push(GpuLayer {
                input_layernorm: vector(Vector::InputNorm(l), h)?,
                post_attention_layernorm: vector(Vector::PostNorm(l), h)?,
                mixer,
                router,
                experts_gate,
                experts_up,
                experts_down,
                shared_gate,
                shared_up,
                shared_down,
            });
        }
        let lm_head = GpuMatrix::alloc(gpu, c.vocab_size, h, 4)?;
        fill(&[Mat::LmHead], &lm_head)?;
        let final_norm = vector(Vector::FinalNorm, h)?;
        progress(total, total);
        Ok(GpuWeights {
            embed_tokens,
            layers,
            final_norm,
            lm_head,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tiling moves every word to its own place (a permutation), keeps each block of rows within the words it
    /// spans, and puts a piece of a block's rows in one run, row after row.
    #[test]
    fn tiling_is_a_permutation_within_blocks() {
        for (rows, row_words, piece_words) in [(128, 32, 16), (256, 64, 16), (384, 8, 2), (128, 32, 2)] {
            let words: Vec<u32> = (0..(rows * row_words) as u32).collect();
            let tiled = tile_words(&words, row_words, piece_words);
            let mut sorted = tiled.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, words, "{rows}x{row_words}: a permutation");
            let block = TILED_ROWS * row_words;
            for (i, &w) in tiled.iter().enumerate() {
                assert_eq!(i / block, w as usize / block, "a word stays in its block");
            }
            // Piece 1 of the first block: row r's words of that piece, rows in order.
            let run = &tiled[TILED_ROWS * piece_words..2 * TILED_ROWS * piece_words];
            for (i, &w) in run.iter().enumerate() {
                let (r, c) = (i / piece_words, i % piece_words);
                assert_eq!(w as usize, r * row_words + piece_words + c);
            }
        }
    }
}
