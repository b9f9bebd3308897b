//! Values every backend derives from the config in the same way: each layer's slot among the layers of its kind,
//! and RoPE's inverse frequencies.

use crate::config::{Config, LayerKind};

impl Config {
    /// Each layer's index among the layers of its kind: the DeltaNet layers' and the full-attention layers' state
    /// (recurrent and conv state, KV cache) is kept per kind, in layer order.
    pub fn layer_slots(&self) -> Vec<usize> {
        let (mut full, mut linear) = (0, 0);
        self.layer_types
            .iter()
            .map(|kind| {
                let count = match kind {
                    LayerKind::Full => &mut full,
                    LayerKind::Linear => &mut linear,
                };
                *count += 1;
                *count - 1
            })
            .collect()
    }

    /// Inverse frequencies of the rotated dims, computed as transformers does (f32 powers of theta).
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        rope_inv_freq(self.rope_theta, self.rotary_dim())
    }
}

/// Inverse frequencies of `rotary_dim` rotated dims for base `theta` (f32 powers of theta, as transformers computes
/// them).
pub fn rope_inv_freq(theta: f64, rotary_dim: usize) -> Vec<f32> {
    (0..rotary_dim / 2)
        .map(|i| 1.0 / (theta as f32).powf((2 * i) as f32 / rotary_dim as f32))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_slots_count_each_kind_in_order() {
        let mut c = Config::tiny_shape();
        c.layer_types = vec![
            LayerKind::Linear,
            LayerKind::Linear,
            LayerKind::Full,
            LayerKind::Linear,
            LayerKind::Full,
        ];
        assert_eq!(c.layer_slots(), vec![0, 1, 0, 2, 1]);
    }

    #[test]
    fn rope_inv_freq_starts_at_one_and_falls() {
        let inv = rope_inv_freq(1e7, 64);
        assert_eq!(inv.len(), 32);
        assert_eq!(inv[0], 1.0);
        assert!(inv.windows(2).all(|w| w[1] < w[0]));
        assert!((inv[16] - 1.0 / 1e7f32.sqrt()).abs() < 1e-9);
    }
}
