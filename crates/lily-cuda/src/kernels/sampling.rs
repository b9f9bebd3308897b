//! The head (kernels/sampling.cu): the final norm and lm_head with the greedy choice, and the sampler.

use super::signature::launchers;
use super::{KernelFile, Q4};
use crate::driver::DevPtr;

pub const FILE: KernelFile<'static> = KernelFile {
    name: "sampling.cu",
    source: include_str!("../../kernels/sampling.cu"),
    kernels: KERNELS,
    constants: &[],
};

launchers! {
    /// `logits = w . rmsnorm(hidden) * norm`, and the largest logit's id (the lowest on ties) into `next_token`.
    lm_head(
        hidden: DevPtr<f32>,
        norm: DevPtr<f32>,
        w: Q4,
        logits: DevPtr<f32>,
        block_best: DevPtr<f32>,
        block_arg: DevPtr<i32>,
        blocks_done: DevPtr<u32>,
        next_token: DevPtr<i32>,
    );
    /// One token drawn from `logits` with the sampling parameters into `next_token`.
    sample(
        logits: DevPtr<f32>,
        temperature: f32,
        top_k: i32,
        top_p: f32,
        min_p: f32,
        seed: u64,
        counter: u64,
        next_token: DevPtr<i32>,
    );
}
