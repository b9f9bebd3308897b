//! Random fills on the GPU (kernels/synth.cu): generated weights in the checkpoint's layout, and uniform values
//! for benchmark state.

use half::{bf16, f16};

use super::signature::launchers;
use super::KernelFile;
use crate::driver::DevPtr;

pub const FILE: KernelFile<'static> = KernelFile {
    name: "synth.cu",
    source: include_str!("../../kernels/synth.cu"),
    kernels: KERNELS,
    buffers: &[],
    constants: &[],
};

launchers! {
    /// `n` random packed words of stream `stream`.
    synth_packed(out: DevPtr<u32>, n: u64, seed: u64, stream: u64);
    /// `n` (scale, bias) bf16 pairs of stream `stream`, scales around `base`.
    synth_scale_bias(out: DevPtr<u32>, n: u64, seed: u64, stream: u64, base: f32, levels: f32);
    /// `n` uniform values in `lo .. hi`.
    fill_uniform_f32(out: DevPtr<f32>, n: u64, seed: u64, stream: u64, lo: f32, hi: f32);
    /// `n` uniform values in `lo .. hi`, as bf16.
    fill_uniform_bf16(out: DevPtr<bf16>, n: u64, seed: u64, stream: u64, lo: f32, hi: f32);
    /// `n` uniform values in `lo .. hi`, as f16.
    fill_uniform_f16(out: DevPtr<f16>, n: u64, seed: u64, stream: u64, lo: f32, hi: f32);
}
