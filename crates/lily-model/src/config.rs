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

/// Group size of every quantized matrix in lily's layout (MLX's default; HF weights are quantized to it at load).
pub const GROUP_SIZE: usize = 64;

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
        Config::from_json(&value)
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
                .filter(|&n| n > 0)
                .map(|n| n as usize)
                .ok_or_else(|| field_err(name, format!("expected a positive integer, got {v}")))
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

        let eos_token_ids = match text.get("eos_token_id").or_else(|| root_obj.get("eos_token_id")) {
            Some(Value::Array(ids)) => ids.iter().filter_map(Value::as_u64).map(|n| n as u32).collect(),
            Some(Value::Number(n)) => n.as_u64().map(|n| vec![n as u32]).unwrap_or_default(),
            _ => vec![248046, 248044],
        };

        let quantization = match root_obj
            .get("quantization")
            .or_else(|| root_obj.get("quantization_config"))
        {
            None | Some(Value::Null) => None,
            Some(q) => Some(parse_quantization(q)?),
        };

        let config = Config {
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
        config.validate()?;
        Ok(config)
    }

    /// Refuses dimensions the kernels cannot take.
    fn validate(&self) -> Result<(), ConfigError> {
        let multiple = |name: &str, value: usize, of: usize| {
            if value.is_multiple_of(of) {
                Ok(())
            } else {
                Err(field_err(name, format!("{value} is not a multiple of {of}")))
            }
        };
        multiple("hidden_size", self.hidden_size, GROUP_SIZE)?;
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
            for (module, spec) in
                std::iter::once(("<default>", &q.default)).chain(q.overrides.iter().map(|(k, v)| (k.as_str(), v)))
            {
                if spec.group_size != GROUP_SIZE || !matches!(spec.bits, 4 | 8) {
                    return Err(field_err(
                        &format!("quantization.{module}"),
                        format!(
                            "bits {} group_size {} is not supported (affine 4 or 8 bits, group 64)",
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

fn parse_quantization(q: &Value) -> Result<Quantization, ConfigError> {
    let obj = q
        .as_object()
        .ok_or_else(|| field_err("quantization", "expected an object"))?;
    let spec = |name: &str, o: &serde_json::Map<String, Value>| -> Result<QuantSpec, ConfigError> {
        let bits = o
            .get("bits")
            .and_then(Value::as_u64)
            .ok_or_else(|| field_err(&format!("{name}.bits"), "missing or not an integer"))?;
        let group_size = o
            .get("group_size")
            .and_then(Value::as_u64)
            .ok_or_else(|| field_err(&format!("{name}.group_size"), "missing or not an integer"))?;
        if let Some(mode) = o.get("mode").and_then(Value::as_str) {
            if mode != "affine" {
                return Err(field_err(
                    &format!("{name}.mode"),
                    format!("`{mode}` is not supported (only affine)"),
                ));
            }
        }
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
        assert_eq!(c.eos_token_ids, vec![248046, 248044]);
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
        refused(|v| v["quantization"]["group_size"] = 32.into(), "quantization");
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
}
