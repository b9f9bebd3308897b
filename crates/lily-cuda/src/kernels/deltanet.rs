//! The decode step's Gated DeltaNet (kernels/deltanet.cu), for a batch of rows each in its own sequence slot: the
//! causal conv over the ring of recent inputs, the gates and the delta-rule update of the recurrent state (f16); in the
//! batched step also the gated RMSNorm of the output rows.

use half::{bf16, f16};

use super::signature::launchers;
use super::{KernelFile, Q8x2};
use crate::driver::DevPtr;

pub const FILE: KernelFile<'static> = KernelFile {
    name: "deltanet.cu",
    source: include_str!("../../kernels/deltanet.cu"),
    kernels: KERNELS,
    buffers: &[],
    constants: &["deltanet_split"],
};

launchers! {
    /// One token a row through the mixer: row b's `proj` (q k v z b a) in, the ring and state of slot `slots[b]`
    /// updated, its `core` row out. Grid (value heads, `deltanet_split`, rows).
    deltanet_step(
        positions: DevPtr<i32>,
        slots: DevPtr<i32>,
        proj: DevPtr<f32>,
        ring: DevPtr<f32>,
        conv1d: DevPtr<f32>,
        a_log: DevPtr<f32>,
        dt_bias: DevPtr<f32>,
        state: DevPtr<f16>,
        core: DevPtr<f32>,
    );
    /// `deltanet_step` for a batched step of many rows, a head a block, ending with the head's gated RMSNorm (z from
    /// the proj rows, weights `norm_w`) into bf16 `normed`, also coded as the small tiling's Q8x2 rows unless
    /// `codes` is [`Q8x2::NONE`]. Where `normed` is null, the raw output into `core` as `deltanet_step` writes it
    /// (what the selftest checks the recurrence by). Grid (value heads, 1, rows).
    deltanet_step_rows(
        positions: DevPtr<i32>,
        slots: DevPtr<i32>,
        proj: DevPtr<f32>,
        ring: DevPtr<f32>,
        conv1d: DevPtr<f32>,
        a_log: DevPtr<f32>,
        dt_bias: DevPtr<f32>,
        state: DevPtr<f16>,
        core: DevPtr<f32>,
        norm_w: DevPtr<f32>,
        normed: DevPtr<bf16>,
        codes: Q8x2,
    );
}
