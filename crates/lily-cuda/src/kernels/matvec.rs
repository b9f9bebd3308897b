//! The decode step's matrix-vector kernels (kernels/matvec.cu): the embedding, the mixers' normed input
//! projections and their output projections, and the position's advance.

use super::signature::launchers;
use super::{KernelFile, Q4};
use crate::driver::DevPtr;

pub const FILE: KernelFile<'static> = KernelFile {
    name: "matvec.cu",
    source: include_str!("../../kernels/matvec.cu"),
    kernels: KERNELS,
    buffers: &[],
    constants: &["rows_per_block_hidden", "rows_per_block_linear_v", "rows_per_block_q"],
};

launchers! {
    /// `hidden = embed_tokens[tokens[*position]]`, dequantized.
    embed(position: DevPtr<i32>, tokens: DevPtr<i32>, table: Q4, hidden: DevPtr<f32>);
    /// `out[r] = w[r] . rmsnorm(hidden) * norm` for `r < rows`.
    proj_normed(hidden: DevPtr<f32>, norm: DevPtr<f32>, w: Q4, out: DevPtr<f32>, rows: i32);
    /// `hidden += w . gated_norm(core, z)`: the Gated DeltaNet's output projection.
    out_proj_deltanet(core: DevPtr<f32>, z: DevPtr<f32>, norm_w: DevPtr<f32>, w: Q4, hidden: DevPtr<f32>);
    /// `hidden += w . attn`: the full attention's output projection.
    out_proj_attn(attn: DevPtr<f32>, w: Q4, hidden: DevPtr<f32>);
    /// `*position += 1`.
    advance_position(position: DevPtr<i32>);
}
