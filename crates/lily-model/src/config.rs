//! The model's configuration, read from a checkpoint's `config.json` (HF or MLX) and checked against what this
//! engine implements. Every dimension the forward pass uses comes from here.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("{path}: not valid JSON: {source}")]
    Json { path: String, source: serde_json::Error },
    #[error("config field `{field}`: {message}")]
    Field { field: String, message: String },
}

fn field_err(field: &str, message: impl Into<String>) -> ConfigError {
    ConfigError::Field {
        field: field.to_string(),
        message: message.into(),
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerKind {
    #[serde(rename = "linear_attention")]
    Linear,
    #[serde(rename = "full_attention")]
    Full,
}

/// Affine quantization of one module: `w = scale * q + bias`, one scale/bias per `group_size` inputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct QuantSpec {
    pub bits: u32,
    pub group_size: usize,
}

/// The `quantization` block of an MLX checkpoint: a default and per-module overrides.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Quantization {
    pub default: QuantSpec,
    /// Module path (as in the checkpoint, without `.weight`) -> spec.
    pub overrides: BTreeMap<String, QuantSpec>,
}

impl Quantization {
    pub fn spec_for(&self, module: &str) -> QuantSpec {
        self.overrides.get(module).copied().unwrap_or(self.default)
    }
}

/// The text model's dimensions. Field names follow HF's `text_config`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Config {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub linear_num_key_heads: usize,
    pub linear_num_value_heads: usize,
    pub linear_key_head_dim: usize,
    pub linear_value_head_dim: usize,
    pub linear_conv_kernel_dim: usize,
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    pub shared_expert_intermediate_size: usize,
    pub rms_norm_eps: f32,
    pub layer_types: Vec<LayerKind>,
    pub max_position_embeddings: usize,
    pub rope_theta: f64,
    pub partial_rotary_factor: f64,
    pub eos_token_ids: Vec<u32>,
    /// None for a bf16 (HF) checkpoint.
    pub quantization: Option<Quantization>,
}

/// What lily loads, for error messages about what it does not.
pub const SUPPORTED_FORMATS: &str = "lily loads MLX affine 4-bit checkpoints with group size 64 (the router and the \
     shared-expert gate may be 8-bit), or unquantized BF16/F16/F32 checkpoints (HF or MLX names), which it \
     quantizes to that layout at load";

/// Group size of every quantized matrix in lily's layout (MLX's default; HF weights are quantized to it at load).
pub const GROUP_SIZE: usize = 64;

/// Limits of what lily takes, well above this model family's values, so that a hostile or broken config.json is
/// refused before any size is computed from it: every integer field, and the layers, experts, experts a token,
/// conv taps (the CPU decode's fixed arrays) and matrix widths.
const MAX_FIELD: u64 = 1 << 24;
const MAX_LAYERS: usize = 1024;
const MAX_EXPERTS: usize = 4096;
pub const MAX_TOP_K: usize = 16;
pub const MAX_CONV_TAPS: usize = 8;
const MAX_WIDTH: usize = 1 << 16;

impl Config {
    pub fn from_dir(dir: &Path) -> Result<Config, ConfigError> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| ConfigError::Io {
            path: path.display().to_string(),
            source,
        })?;
        let value: Value = serde_json::from_str(&text).map_err(|source| ConfigError::Json {
            path: path.display().to_string(),
            source,
        })?;
        let mut config = Config::from_json(&value)?;
        // The end tokens of generation_config.json and the tokenizer's end-of-turn token join config.json's.
        let mut extra = GenerationConfig::from_dir(dir)?
            .map(|g| g.eos_token_ids)
            .unwrap_or_default();
        extra.extend(end_of_turn_token(dir));
        for id in extra {
            if !config.eos_token_ids.contains(&id) {
                config.eos_token_ids.push(id);
            }
        }
        Ok(config)
    }

    pub fn from_json(root: &Value) -> Result<Config, ConfigError> {
        let root_obj = root
            .as_object()
            .ok_or_else(|| field_err("<root>", "expected a JSON object"))?;
        let text = match root_obj.get("text_config") {
            Some(t) => t
                .as_object()
                .ok_or_else(|| field_err("text_config", "expected an object"))?,
            None => root_obj,
        };
        let model_type = text
            .get("model_type")
            .or_else(|| root_obj.get("model_type"))
            .and_then(Value::as_str)
            .unwrap_or("");
        if !matches!(model_type, "qwen3_5_moe" | "qwen3_5_moe_text") {
            return Err(field_err(
                "model_type",
                format!("`{model_type}` is not supported: lily runs qwen3_5_moe (Qwen3.5/3.6 MoE) only"),
            ));
        }
        if let Some(bias) = text.get("attention_bias").and_then(Value::as_bool) {
            if bias {
                return Err(field_err(
                    "attention_bias",
                    "true is not supported (this model family has no bias)",
                ));
            }
        }
        if let Some(act) = text.get("hidden_act").and_then(Value::as_str) {
            if act != "silu" {
                return Err(field_err("hidden_act", format!("`{act}` is not supported (only silu)")));
            }
        }

        let usize_field = |name: &str| -> Result<usize, ConfigError> {
            let v = text.get(name).ok_or_else(|| field_err(name, "missing"))?;
            v.as_u64()
                .filter(|&n| n > 0 && n <= MAX_FIELD)
                .map(|n| n as usize)
                .ok_or_else(|| field_err(name, format!("expected a positive integer up to {MAX_FIELD}, got {v}")))
        };
        let f64_field = |obj: &serde_json::Map<String, Value>, name: &str| -> Result<f64, ConfigError> {
            let v = obj.get(name).ok_or_else(|| field_err(name, "missing"))?;
            v.as_f64()
                .ok_or_else(|| field_err(name, format!("expected a number, got {v}")))
        };

        let num_hidden_layers = usize_field("num_hidden_layers")?;
        let layer_types = match text.get("layer_types") {
            Some(Value::Array(items)) => items
                .iter()
                .enumerate()
                .map(|(i, v)| match v.as_str() {
                    Some("linear_attention") => Ok(LayerKind::Linear),
                    Some("full_attention") => Ok(LayerKind::Full),
                    _ => Err(field_err(
                        &format!("layer_types[{i}]"),
                        format!("{v} is not supported (linear_attention or full_attention)"),
                    )),
                })
                .collect::<Result<Vec<_>, _>>()?,
            Some(other) => return Err(field_err("layer_types", format!("expected a list, got {other}"))),
            None => {
                let interval = text.get("full_attention_interval").and_then(Value::as_u64).unwrap_or(4) as usize;
                (0..num_hidden_layers)
                    .map(|i| {
                        if (i + 1) % interval.max(1) == 0 {
                            LayerKind::Full
                        } else {
                            LayerKind::Linear
                        }
                    })
                    .collect()
            }
        };
        if layer_types.len() != num_hidden_layers {
            return Err(field_err(
                "layer_types",
                format!(
                    "has {} entries but num_hidden_layers is {num_hidden_layers}",
                    layer_types.len()
                ),
            ));
        }

        let rope = match text.get("rope_parameters").or_else(|| text.get("rope_scaling")) {
            Some(Value::Object(r)) => r.clone(),
            _ => serde_json::Map::new(),
        };
        if let Some(rt) = rope.get("rope_type").and_then(Value::as_str) {
            if rt != "default" {
                return Err(field_err(
                    "rope_parameters.rope_type",
                    format!("`{rt}` is not supported (only default)"),
                ));
            }
        }
        let rope_theta = f64_field(&rope, "rope_theta").or_else(|_| f64_field(text, "rope_theta"))?;
        let partial_rotary_factor = f64_field(&rope, "partial_rotary_factor")
            .or_else(|_| f64_field(text, "partial_rotary_factor"))
            .unwrap_or(1.0);

        // Released checkpoints spread their end tokens: the HF config.json names only `<|endoftext|>` in
        // text_config, mlx-lm copies generation_config.json's list to the root. Every one of them ends a reply.
        let mut eos_token_ids = Vec::new();
        extend_token_ids(&mut eos_token_ids, text.get("eos_token_id"));
        extend_token_ids(&mut eos_token_ids, root_obj.get("eos_token_id"));

        let quantization = match root_obj
            .get("quantization")
            .or_else(|| root_obj.get("quantization_config"))
        {
            None | Some(Value::Null) => None,
            Some(q) => Some(parse_quantization(q)?),
        };

        let mut config = Config {
            vocab_size: usize_field("vocab_size")?,
            hidden_size: usize_field("hidden_size")?,
            num_hidden_layers,
            num_attention_heads: usize_field("num_attention_heads")?,
            num_key_value_heads: usize_field("num_key_value_heads")?,
            head_dim: usize_field("head_dim")?,
            linear_num_key_heads: usize_field("linear_num_key_heads")?,
            linear_num_value_heads: usize_field("linear_num_value_heads")?,
            linear_key_head_dim: usize_field("linear_key_head_dim")?,
            linear_value_head_dim: usize_field("linear_value_head_dim")?,
            linear_conv_kernel_dim: usize_field("linear_conv_kernel_dim")?,
            num_experts: usize_field("num_experts")?,
            num_experts_per_tok: usize_field("num_experts_per_tok")?,
            moe_intermediate_size: usize_field("moe_intermediate_size")?,
            shared_expert_intermediate_size: usize_field("shared_expert_intermediate_size")?,
            rms_norm_eps: f64_field(text, "rms_norm_eps")? as f32,
            layer_types,
            max_position_embeddings: usize_field("max_position_embeddings")?,
            rope_theta,
            partial_rotary_factor,
            eos_token_ids,
            quantization,
        };
        if config.eos_token_ids.is_empty() {
            config.eos_token_ids = DEFAULT_EOS_TOKEN_IDS.to_vec();
        }
        config.validate()?;
        Ok(config)
    }

    /// Refuses dimensions the kernels cannot take.
    fn validate(&self) -> Result<(), ConfigError> {
        let at_most = |name: &str, value: usize, most: usize| {
            if value <= most {
                Ok(())
            } else {
                Err(field_err(name, format!("{value} is more than the {most} lily takes")))
            }
        };
        at_most("num_hidden_layers", self.num_hidden_layers, MAX_LAYERS)?;
        at_most("num_experts", self.num_experts, MAX_EXPERTS)?;
        at_most("num_experts_per_tok", self.num_experts_per_tok, MAX_TOP_K)?;
        at_most("linear_conv_kernel_dim", self.linear_conv_kernel_dim, MAX_CONV_TAPS)?;
        for (name, value) in [
            ("hidden_size", self.hidden_size),
            ("moe_intermediate_size", self.moe_intermediate_size),
            ("shared_expert_intermediate_size", self.shared_expert_intermediate_size),
            ("head_dim", self.head_dim),
            ("linear_key_head_dim", self.linear_key_head_dim),
            ("num_attention_heads * head_dim", self.q_dim()),
            (
                "linear_num_value_heads * linear_value_head_dim",
                self.linear_value_dim(),
            ),
        ] {
            at_most(name, value, MAX_WIDTH)?;
        }
        for (name, value) in [
            ("rms_norm_eps", self.rms_norm_eps as f64),
            ("rope_theta", self.rope_theta),
        ] {
            if !(value.is_finite() && value > 0.0) {
                return Err(field_err(name, format!("{value} is not a positive number")));
            }
        }
        let multiple = |name: &str, value: usize, of: usize| {
            if value.is_multiple_of(of) {
                Ok(())
            } else {
                Err(field_err(name, format!("{value} is not a multiple of {of}")))
            }
        };
        multiple("hidden_size", self.hidden_size, GROUP_SIZE)?;
        // The output projections' inputs are quantized in groups too.
        multiple("num_attention_heads * head_dim", self.q_dim(), GROUP_SIZE)?;
        multiple(
            "linear_num_value_heads * linear_value_head_dim",
            self.linear_value_dim(),
            GROUP_SIZE,
        )?;
        multiple("moe_intermediate_size", self.moe_intermediate_size, GROUP_SIZE)?;
        multiple(
            "shared_expert_intermediate_size",
            self.shared_expert_intermediate_size,
            GROUP_SIZE,
        )?;
        multiple(
            "num_attention_heads",
            self.num_attention_heads,
            self.num_key_value_heads,
        )?;
        multiple(
            "linear_num_value_heads",
            self.linear_num_value_heads,
            self.linear_num_key_heads,
        )?;
        multiple("head_dim", self.head_dim, 2)?;
        if self.linear_key_head_dim != self.linear_value_head_dim {
            return Err(field_err(
                "linear_value_head_dim",
                format!(
                    "{} differs from linear_key_head_dim {}",
                    self.linear_value_head_dim, self.linear_key_head_dim
                ),
            ));
        }
        if self.num_experts_per_tok > self.num_experts {
            return Err(field_err(
                "num_experts_per_tok",
                format!("{} exceeds num_experts {}", self.num_experts_per_tok, self.num_experts),
            ));
        }
        if self.linear_conv_kernel_dim < 2 {
            return Err(field_err("linear_conv_kernel_dim", "must be at least 2"));
        }
        let rotary = self.rotary_dim();
        if rotary == 0 || !rotary.is_multiple_of(2) || rotary > self.head_dim {
            return Err(field_err(
                "partial_rotary_factor",
                format!(
                    "{} gives a rotary dim of {rotary} for head_dim {}",
                    self.partial_rotary_factor, self.head_dim
                ),
            ));
        }
        if !self.layer_types.contains(&LayerKind::Full) {
            return Err(field_err("layer_types", "no full_attention layer"));
        }
        if let Some(q) = &self.quantization {
            if q.default.bits != 4 || q.default.group_size != GROUP_SIZE {
                return Err(field_err(
                    "quantization",
                    format!(
                        "found MLX affine {}-bit, group {}: not supported. {SUPPORTED_FORMATS}",
                        q.default.bits, q.default.group_size
                    ),
                ));
            }
            for (module, spec) in &q.overrides {
                // The router and the shared-expert gate are the only modules lily runs at 8 bits.
                let eight_bit_module = module.ends_with(".mlp.gate") || module.ends_with(".mlp.shared_expert_gate");
                let allowed = spec.group_size == GROUP_SIZE && (spec.bits == 4 || (spec.bits == 8 && eight_bit_module));
                if !allowed {
                    return Err(field_err(
                        &format!("quantization.{module}"),
                        format!(
                            "found a mixed-bit recipe ({}-bit, group {} for this module): not supported. \
                             {SUPPORTED_FORMATS}",
                            spec.bits, spec.group_size
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    pub fn rotary_dim(&self) -> usize {
        (self.head_dim as f64 * self.partial_rotary_factor).round() as usize
    }
    pub fn q_dim(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }
    pub fn linear_key_dim(&self) -> usize {
        self.linear_num_key_heads * self.linear_key_head_dim
    }
    pub fn linear_value_dim(&self) -> usize {
        self.linear_num_value_heads * self.linear_value_head_dim
    }
    /// Channels of the depthwise conv: q, k and v of the Gated DeltaNet.
    pub fn linear_conv_dim(&self) -> usize {
        2 * self.linear_key_dim() + self.linear_value_dim()
    }
    pub fn num_full_layers(&self) -> usize {
        self.layer_types.iter().filter(|k| **k == LayerKind::Full).count()
    }
    pub fn num_linear_layers(&self) -> usize {
        self.num_hidden_layers - self.num_full_layers()
    }

    /// The real model's shape (Qwen3.6-35B-A3B).
    pub fn full_shape() -> Config {
        Config {
            vocab_size: 248320,
            hidden_size: 2048,
            num_hidden_layers: 40,
            num_attention_heads: 16,
            num_key_value_heads: 2,
            head_dim: 256,
            linear_num_key_heads: 16,
            linear_num_value_heads: 32,
            linear_key_head_dim: 128,
            linear_value_head_dim: 128,
            linear_conv_kernel_dim: 4,
            num_experts: 256,
            num_experts_per_tok: 8,
            moe_intermediate_size: 512,
            shared_expert_intermediate_size: 512,
            rms_norm_eps: 1e-6,
            layer_types: (0..40)
                .map(|i| if i % 4 == 3 { LayerKind::Full } else { LayerKind::Linear })
                .collect(),
            max_position_embeddings: 262144,
            rope_theta: 1e7,
            partial_rotary_factor: 0.25,
            eos_token_ids: vec![248046, 248044],
            quantization: None,
        }
    }

    /// A tiny model of the same structure and per-head dims (the shape of lily-tiny-shakespeare).
    pub fn tiny_shape() -> Config {
        Config {
            hidden_size: 128,
            num_hidden_layers: 8,
            num_attention_heads: 8,
            num_key_value_heads: 1,
            linear_num_key_heads: 4,
            linear_num_value_heads: 8,
            num_experts: 16,
            moe_intermediate_size: 256,
            shared_expert_intermediate_size: 256,
            layer_types: (0..8)
                .map(|i| if i % 4 == 3 { LayerKind::Full } else { LayerKind::Linear })
                .collect(),
            ..Config::full_shape()
        }
    }

    /// config.json in MLX layout (text config nested, `quantization` block with 8-bit router and shared gate).
    pub fn to_mlx_json(&self) -> Value {
        let mut overrides = serde_json::Map::new();
        for layer in 0..self.num_hidden_layers {
            for module in ["mlp.gate", "mlp.shared_expert_gate"] {
                overrides.insert(
                    format!("language_model.model.layers.{layer}.{module}"),
                    serde_json::json!({"group_size": GROUP_SIZE, "bits": 8}),
                );
            }
        }
        let mut quant = serde_json::json!({"group_size": GROUP_SIZE, "bits": 4, "mode": "affine"});
        quant.as_object_mut().unwrap().extend(overrides);
        let layer_types: Vec<&str> = self
            .layer_types
            .iter()
            .map(|k| match k {
                LayerKind::Linear => "linear_attention",
                LayerKind::Full => "full_attention",
            })
            .collect();
        serde_json::json!({
            "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "model_type": "qwen3_5_moe",
            "text_config": {
                "model_type": "qwen3_5_moe_text",
                "vocab_size": self.vocab_size,
                "hidden_size": self.hidden_size,
                "num_hidden_layers": self.num_hidden_layers,
                "num_attention_heads": self.num_attention_heads,
                "num_key_value_heads": self.num_key_value_heads,
                "head_dim": self.head_dim,
                "linear_num_key_heads": self.linear_num_key_heads,
                "linear_num_value_heads": self.linear_num_value_heads,
                "linear_key_head_dim": self.linear_key_head_dim,
                "linear_value_head_dim": self.linear_value_head_dim,
                "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
                "num_experts": self.num_experts,
                "num_experts_per_tok": self.num_experts_per_tok,
                "moe_intermediate_size": self.moe_intermediate_size,
                "shared_expert_intermediate_size": self.shared_expert_intermediate_size,
                "rms_norm_eps": self.rms_norm_eps,
                "layer_types": layer_types,
                "max_position_embeddings": self.max_position_embeddings,
                "tie_word_embeddings": false,
                "hidden_act": "silu",
                "attention_bias": false,
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": self.rope_theta,
                    "partial_rotary_factor": self.partial_rotary_factor,
                    "mrope_section": [11, 11, 10],
                    "mrope_interleaved": true
                },
                "eos_token_id": self.eos_token_ids,
            },
            "tie_word_embeddings": false,
            "quantization": quant.clone(),
            "quantization_config": quant,
        })
    }
}

/// End-of-sequence ids of the model family, used when no file names any.
pub const DEFAULT_EOS_TOKEN_IDS: [u32; 2] = [248046, 248044];

/// Appends the ids of an `eos_token_id` field (a number or a list of numbers) that `ids` lacks.
fn extend_token_ids(ids: &mut Vec<u32>, value: Option<&Value>) {
    let found: Vec<u32> = match value {
        Some(Value::Array(items)) => items
            .iter()
            .filter_map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok()))
            .collect(),
        Some(Value::Number(n)) => n
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .map(|n| vec![n])
            .unwrap_or_default(),
        _ => Vec::new(),
    };
    for id in found {
        if !ids.contains(&id) {
            ids.push(id);
        }
    }
}

/// The tokenizer's end-of-turn token: `eos_token` of tokenizer_config.json (`<|im_end|>` in the Qwen releases),
/// as numbered by its `added_tokens_decoder`. None where either is missing.
fn end_of_turn_token(dir: &Path) -> Option<u32> {
    let text = std::fs::read_to_string(dir.join("tokenizer_config.json")).ok()?;
    let value: Value = serde_json::from_str(&text).ok()?;
    let eos = match value.get("eos_token")? {
        Value::String(s) => s.as_str(),
        Value::Object(o) => o.get("content")?.as_str()?,
        _ => return None,
    };
    value
        .get("added_tokens_decoder")?
        .as_object()?
        .iter()
        .find(|(_, token)| token.get("content").and_then(Value::as_str) == Some(eos))
        .and_then(|(id, _)| id.parse().ok())
}

/// The model's `generation_config.json`: its end tokens and the sampling defaults it ships with. Each sampling
/// value is kept only when it is in range (a value out of range is ignored with a warning, as if absent).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GenerationConfig {
    pub eos_token_ids: Vec<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
}

impl GenerationConfig {
    /// Reads `dir/generation_config.json`; None when there is none. A file that is not a JSON object is an error.
    pub fn from_dir(dir: &Path) -> Result<Option<GenerationConfig>, ConfigError> {
        let path = dir.join("generation_config.json");
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => {
                return Err(ConfigError::Io {
                    path: path.display().to_string(),
                    source,
                })
            }
        };
        let value: Value = serde_json::from_str(&text).map_err(|source| ConfigError::Json {
            path: path.display().to_string(),
            source,
        })?;
        let obj = value
            .as_object()
            .ok_or_else(|| field_err("generation_config.json", "expected a JSON object"))?;
        let mut config = GenerationConfig::default();
        extend_token_ids(&mut config.eos_token_ids, obj.get("eos_token_id"));
        let number = |key: &str, valid: fn(f64) -> bool| -> Option<f64> {
            let v = obj.get(key)?;
            match v.as_f64() {
                Some(n) if valid(n) => Some(n),
                _ => {
                    tracing::warn!("{}: ignoring `{key}`: {v} is out of range", path.display());
                    None
                }
            }
        };
        config.temperature = number("temperature", |v| v.is_finite() && v >= 0.0).map(|v| v as f32);
        config.top_p = number("top_p", |v| v > 0.0 && v <= 1.0).map(|v| v as f32);
        config.top_k = number("top_k", |v| v >= 0.0 && v.fract() == 0.0).map(|v| v as usize);
        config.min_p = number("min_p", |v| (0.0..=1.0).contains(&v)).map(|v| v as f32);
        config.repetition_penalty = number("repetition_penalty", |v| v.is_finite() && v > 0.0).map(|v| v as f32);
        Ok(Some(config))
    }
}

fn parse_quantization(q: &Value) -> Result<Quantization, ConfigError> {
    let obj = q
        .as_object()
        .ok_or_else(|| field_err("quantization", "expected an object"))?;
    // Hugging Face quantizers (FP8, NVFP4 through ModelOpt or compressed-tensors, GPTQ, AWQ...) name themselves
    // in `quant_method`; MLX's block has none.
    if let Some(method) = obj.get("quant_method") {
        let detail: Vec<String> = ["quant_algo", "fmt", "format", "bits", "weight_block_size"]
            .iter()
            .filter_map(|key| obj.get(*key).map(|v| format!("{key} {v}")))
            .collect();
        return Err(field_err(
            "quantization_config.quant_method",
            format!(
                "found {method}{}: not supported. {SUPPORTED_FORMATS}",
                if detail.is_empty() {
                    String::new()
                } else {
                    format!(" ({})", detail.join(", "))
                }
            ),
        ));
    }
    let spec = |name: &str, o: &serde_json::Map<String, Value>| -> Result<QuantSpec, ConfigError> {
        if let Some(mode) = o.get("mode").and_then(Value::as_str) {
            if mode != "affine" {
                return Err(field_err(
                    &format!("{name}.mode"),
                    format!("found MLX `{mode}` quantization: not supported. {SUPPORTED_FORMATS}"),
                ));
            }
        }
        let bits = o
            .get("bits")
            .and_then(Value::as_u64)
            .ok_or_else(|| field_err(&format!("{name}.bits"), "missing or not an integer"))?;
        let group_size = o
            .get("group_size")
            .and_then(Value::as_u64)
            .ok_or_else(|| field_err(&format!("{name}.group_size"), "missing or not an integer"))?;
        Ok(QuantSpec {
            bits: bits as u32,
            group_size: group_size as usize,
        })
    };
    let default = spec("quantization", obj)?;
    let mut overrides = BTreeMap::new();
    for (key, value) in obj {
        if let Value::Object(o) = value {
            overrides.insert(key.clone(), spec(&format!("quantization.{key}"), o)?);
        }
    }
    Ok(Quantization { default, overrides })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shakespeare_json() -> Value {
        let text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../models/lily-tiny-shakespeare/config.json"
        ))
        .unwrap();
        serde_json::from_str(&text).unwrap()
    }

    #[test]
    fn reads_the_default_model_config() {
        let c = Config::from_json(&shakespeare_json()).unwrap();
        assert_eq!(c.hidden_size, 128);
        assert_eq!(c.num_full_layers(), 2);
        assert_eq!(c.rotary_dim(), 64);
        assert_eq!(c.linear_conv_dim(), 2048);
        let q = c.quantization.as_ref().unwrap();
        assert_eq!(q.spec_for("language_model.model.layers.3.mlp.gate").bits, 8);
        assert_eq!(
            q.spec_for("language_model.model.layers.3.mlp.switch_mlp.up_proj").bits,
            4
        );
        // The released layout: config.json names only `<|endoftext|>`, generation_config.json adds `<|im_end|>`.
        assert_eq!(c.eos_token_ids, vec![248044]);
        let dir = Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../models/lily-tiny-shakespeare"
        ));
        assert_eq!(Config::from_dir(dir).unwrap().eos_token_ids, vec![248044, 248046]);
        let generation = GenerationConfig::from_dir(dir).unwrap().unwrap();
        assert_eq!(
            (generation.temperature, generation.top_p, generation.top_k),
            (Some(1.0), Some(0.95), Some(20))
        );
    }

    fn write_dir(files: &[(&str, Value)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for (name, value) in files {
            std::fs::write(dir.path().join(name), value.to_string()).unwrap();
        }
        dir
    }

    #[test]
    fn end_tokens_are_the_union_of_every_file_that_names_them() {
        // HF release: text_config has 248044 only; generation_config.json has the list.
        let mut hf = shakespeare_json();
        let generation = serde_json::json!({"eos_token_id": [248046, 248044], "top_k": 20});
        let dir = write_dir(&[("config.json", hf.clone()), ("generation_config.json", generation)]);
        assert_eq!(
            Config::from_dir(dir.path()).unwrap().eos_token_ids,
            vec![248044, 248046]
        );

        // mlx-lm conversion: the list copied to the root of config.json, no generation_config.json.
        hf["eos_token_id"] = serde_json::json!([248046, 248044]);
        let dir = write_dir(&[("config.json", hf.clone())]);
        assert_eq!(
            Config::from_dir(dir.path()).unwrap().eos_token_ids,
            vec![248044, 248046]
        );

        // Only the tokenizer names the end of turn.
        hf.as_object_mut().unwrap().remove("eos_token_id");
        let tokenizer_config = serde_json::json!({
            "eos_token": "<|im_end|>",
            "added_tokens_decoder": {
                "248044": {"content": "<|endoftext|>", "special": true},
                "248046": {"content": "<|im_end|>", "special": true}
            }
        });
        let dir = write_dir(&[("config.json", hf.clone()), ("tokenizer_config.json", tokenizer_config)]);
        assert_eq!(
            Config::from_dir(dir.path()).unwrap().eos_token_ids,
            vec![248044, 248046]
        );

        // No file names any: the family's two.
        hf["text_config"].as_object_mut().unwrap().remove("eos_token_id");
        assert_eq!(Config::from_json(&hf).unwrap().eos_token_ids, DEFAULT_EOS_TOKEN_IDS);
    }

    #[test]
    fn generation_config_values_out_of_range_are_dropped_and_a_broken_file_is_an_error() {
        let generation = serde_json::json!({"temperature": -1, "top_p": 0.8, "top_k": 2.5, "min_p": 0.1});
        let dir = write_dir(&[("generation_config.json", generation)]);
        let g = GenerationConfig::from_dir(dir.path()).unwrap().unwrap();
        assert_eq!(
            (g.temperature, g.top_p, g.top_k, g.min_p),
            (None, Some(0.8), None, Some(0.1))
        );
        std::fs::write(dir.path().join("generation_config.json"), "[1]").unwrap();
        assert!(GenerationConfig::from_dir(dir.path()).is_err());
        let empty = tempfile::tempdir().unwrap();
        assert_eq!(GenerationConfig::from_dir(empty.path()).unwrap(), None);
    }

    #[test]
    fn mlx_json_round_trips() {
        for shape in [Config::tiny_shape(), Config::full_shape()] {
            let back = Config::from_json(&shape.to_mlx_json()).unwrap();
            assert_eq!(back.layer_types, shape.layer_types);
            assert_eq!(back.hidden_size, shape.hidden_size);
            assert_eq!(back.quantization.unwrap().default.bits, 4);
        }
    }

    fn refused(edit: impl Fn(&mut Value), field: &str) {
        let mut v = shakespeare_json();
        edit(&mut v);
        let err = Config::from_json(&v).unwrap_err().to_string();
        assert!(err.contains(field), "error `{err}` does not name `{field}`");
    }

    #[test]
    fn refuses_what_the_engine_does_not_implement() {
        refused(|v| v["text_config"]["model_type"] = "llama".into(), "model_type");
        refused(|v| v["text_config"]["attention_bias"] = true.into(), "attention_bias");
        refused(
            |v| v["text_config"]["layer_types"][2] = "sliding_attention".into(),
            "layer_types[2]",
        );
        refused(
            |v| {
                v["text_config"]["layer_types"]
                    .as_array_mut()
                    .unwrap()
                    .pop()
                    .map(|_| ())
                    .unwrap()
            },
            "layer_types",
        );
        refused(|v| v["quantization"]["bits"] = 3.into(), "quantization");
        refused(|v| v["quantization"]["mode"] = "mxfp4".into(), "quantization.mode");
        refused(|v| v["text_config"]["hidden_size"] = 100.into(), "hidden_size");
        refused(
            |v| v["text_config"]["num_experts_per_tok"] = 17.into(),
            "num_experts_per_tok",
        );
        refused(|v| v["text_config"]["head_dim"] = "256".into(), "head_dim");
        refused(
            |v| {
                v["text_config"].as_object_mut().unwrap().remove("vocab_size");
            },
            "vocab_size",
        );
        refused(
            |v| v["text_config"]["rope_parameters"]["rope_type"] = "yarn".into(),
            "rope_type",
        );
        refused(|v| v["text_config"]["hidden_act"] = "gelu".into(), "hidden_act");
    }

    #[test]
    fn refuses_sizes_that_would_break_loading_or_decoding() {
        let t = |v: &mut Value| v["text_config"].as_object_mut().unwrap().clone();
        let set = |v: &mut Value, pairs: &[(&str, Value)]| {
            let mut text = t(v);
            for (k, x) in pairs {
                text.insert(k.to_string(), x.clone());
            }
            v["text_config"] = Value::Object(text);
        };
        // Huge counts are refused before anything is sized by them.
        refused(
            |v| set(v, &[("num_hidden_layers", 1_000_000_000_000_000u64.into())]),
            "num_hidden_layers",
        );
        refused(
            |v| {
                v["text_config"].as_object_mut().unwrap().remove("layer_types");
                set(v, &[("num_hidden_layers", 2000.into())]);
            },
            "num_hidden_layers",
        );
        refused(|v| set(v, &[("num_experts", (1u64 << 20).into())]), "num_experts");
        refused(|v| set(v, &[("hidden_size", (1u64 << 20).into())]), "hidden_size");
        // More experts a token or conv taps than the CPU decode's fixed arrays hold.
        refused(
            |v| set(v, &[("num_experts", 32.into()), ("num_experts_per_tok", 17.into())]),
            "num_experts_per_tok",
        );
        refused(
            |v| set(v, &[("linear_conv_kernel_dim", 9.into())]),
            "linear_conv_kernel_dim",
        );
        // The output projections' inputs must be whole quantization groups: 3 heads of 32 are 96 wide.
        refused(
            |v| {
                set(
                    v,
                    &[
                        ("num_attention_heads", 3.into()),
                        ("num_key_value_heads", 1.into()),
                        ("head_dim", 32.into()),
                    ],
                )
            },
            "num_attention_heads * head_dim",
        );
        refused(
            |v| {
                set(
                    v,
                    &[
                        ("linear_num_key_heads", 1.into()),
                        ("linear_num_value_heads", 1.into()),
                        ("linear_key_head_dim", 96.into()),
                        ("linear_value_head_dim", 96.into()),
                    ],
                )
            },
            "linear_num_value_heads * linear_value_head_dim",
        );
        // Norms and rotary frequencies of no sense.
        refused(|v| set(v, &[("rms_norm_eps", 0.into())]), "rms_norm_eps");
        refused(
            |v| v["text_config"]["rope_parameters"]["rope_theta"] = (-1.0).into(),
            "rope_theta",
        );
        // An end-of-sequence id past u32 is not truncated into some other token.
        let mut v = shakespeare_json();
        v["text_config"]["eos_token_id"] = serde_json::json!([248044u64, (1u64 << 32) + 5]);
        let config = Config::from_json(&v).unwrap();
        assert_eq!(config.eos_token_ids, vec![248044]);
    }

    /// The error for a quantization lily does not run names what it found and what lily accepts.
    fn refusal(edit: impl Fn(&mut Value)) -> String {
        let mut v = shakespeare_json();
        edit(&mut v);
        let err = Config::from_json(&v).unwrap_err().to_string();
        assert!(err.contains(SUPPORTED_FORMATS), "{err}");
        err
    }

    #[test]
    fn unsupported_quantizations_are_named_with_what_lily_accepts() {
        let mlx = |edit: fn(&mut serde_json::Map<String, Value>)| {
            move |v: &mut Value| {
                for key in ["quantization", "quantization_config"] {
                    edit(v[key].as_object_mut().unwrap());
                }
            }
        };
        // mlx-lm's 8-bit and group-32 recipes.
        let err = refusal(mlx(|q| q["bits"] = 8.into()));
        assert!(err.contains("8-bit, group 64"), "{err}");
        let err = refusal(mlx(|q| q["group_size"] = 32.into()));
        assert!(err.contains("4-bit, group 32"), "{err}");
        // A mixed-bit recipe: some layers' projections at 6 or 8 bits.
        let err = refusal(mlx(|q| {
            q.insert(
                "language_model.model.layers.0.mlp.switch_mlp.down_proj".into(),
                serde_json::json!({"group_size": 64, "bits": 6}),
            );
        }));
        assert!(
            err.contains("mixed-bit") && err.contains("switch_mlp.down_proj") && err.contains("6-bit"),
            "{err}"
        );
        let err = refusal(mlx(|q| {
            q.insert(
                "language_model.model.layers.0.self_attn.v_proj".into(),
                serde_json::json!({"group_size": 64, "bits": 8}),
            );
        }));
        assert!(err.contains("mixed-bit") && err.contains("v_proj"), "{err}");
        // MLX's non-affine modes.
        let err = refusal(mlx(|q| q["mode"] = "mxfp4".into()));
        assert!(err.contains("mxfp4"), "{err}");

        // The FP8 release (block-wise e4m3) and an NVFP4 checkpoint (ModelOpt, compressed-tensors).
        let hf = |block: Value| {
            move |v: &mut Value| {
                let o = v.as_object_mut().unwrap();
                o.remove("quantization");
                o.insert("quantization_config".into(), block.clone());
            }
        };
        let err = refusal(hf(serde_json::json!({
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]
        })));
        assert!(
            err.contains("\"fp8\"") && err.contains("e4m3") && !err.contains("bits missing"),
            "{err}"
        );
        let err = refusal(hf(
            serde_json::json!({"quant_method": "modelopt", "quant_algo": "NVFP4"}),
        ));
        assert!(err.contains("modelopt") && err.contains("NVFP4"), "{err}");
        let err = refusal(hf(serde_json::json!({
            "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"
        })));
        assert!(err.contains("nvfp4-pack-quantized"), "{err}");
    }
}
