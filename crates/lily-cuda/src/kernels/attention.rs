//! The decode step's gated full attention (kernels/attention.cu): q/k norms, RoPE and the KV cache write; the
//! context split into parts, each attended separately; the parts merged and gated.

use half::bf16;

use super::signature::launchers;
use super::KernelFile;
use crate::driver::DevPtr;

pub const FILE: KernelFile<'static> = KernelFile {
    name: "attention.cu",
    source: include_str!("../../kernels/attention.cu"),
    kernels: KERNELS,
    constants: &[],
};

launchers! {
    /// Normed, rotated queries into `q_out`; the position's key and value into the caches.
    attn_prep(
        position: DevPtr<i32>,
        proj: DevPtr<f32>,
        q_norm: DevPtr<f32>,
        k_norm: DevPtr<f32>,
        inv_freq: DevPtr<f32>,
        q_out: DevPtr<f32>,
        k_cache: DevPtr<bf16>,
        v_cache: DevPtr<bf16>,
    );
    /// One part of the context per block: its unnormalised output, row max and sum.
    attn_partial(
        position: DevPtr<i32>,
        q: DevPtr<f32>,
        k_cache: DevPtr<bf16>,
        v_cache: DevPtr<bf16>,
        part_o: DevPtr<f32>,
        part_ml: DevPtr<f32>,
    );
    /// The parts merged, times sigmoid of the output gate (in `proj`), into `attn`.
    attn_merge(
        position: DevPtr<i32>,
        part_o: DevPtr<f32>,
        part_ml: DevPtr<f32>,
        proj: DevPtr<f32>,
        attn: DevPtr<f32>,
    );
}
