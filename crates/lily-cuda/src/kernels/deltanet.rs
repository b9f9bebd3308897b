//! The decode step's Gated DeltaNet (kernels/deltanet.cu), for a batch of rows each in its own sequence slot: the
//! causal conv over the ring of recent inputs, the gates and the delta-rule update of the recurrent state (f16); and the
//! gated RMSNorm of the output rows.

use half::{bf16, f16};

use super::signature::launchers;
use super::{KernelFile, Q8x2};
use crate::driver::DevPtr;

pub const FILE: KernelFile<'static> = KernelFile {
    name: "deltanet.cu",
    source: include_str!("../../kernels/deltanet.cu"),
    kernels: KERNELS,
    buffers: &[],
    constants: &["deltanet_split", "deltanet_rows_split"],
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
    /// `deltanet_step` for a batched step of many rows: the same computation, a head in `deltanet_rows_split`
    /// blocks. Grid (value heads, `deltanet_rows_split`, rows).
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
    );
    /// The gated RMSNorm of each head of `rows` core rows (z from the proj rows) into bf16 `out`; unless `codes` is
    /// [`Q8x2::NONE`], `out` also coded as the small tiling's Q8x2 rows.
    gated_norm_rows(
        core: DevPtr<f32>,
        proj: DevPtr<f32>,
        norm_w: DevPtr<f32>,
        rows: i32,
        out: DevPtr<bf16>,
        codes: Q8x2,
    );
}
