//! The decode step's sparse MoE block (kernels/moe.cu): the router, the top-k routing and the chosen and shared
//! experts' gate/up projections in one launch, their down projections in the next.

use super::signature::launchers;
use super::{KernelFile, Q4};
use crate::driver::DevPtr;

pub const FILE: KernelFile<'static> = KernelFile {
    name: "moe.cu",
    source: include_str!("../../kernels/moe.cu"),
    kernels: KERNELS,
    buffers: &[],
    constants: &["pairs_per_block", "gate_up_threads", "down_rows_per_block"],
};

launchers! {
    /// The router's logits of `rmsnorm(hidden) * norm`, the routing (ids and weights, then `*route_ready` set),
    /// and `act = silu(gate x) * (up x)` of the chosen experts and the shared one.
    experts_gate_up(
        hidden: DevPtr<f32>,
        norm: DevPtr<f32>,
        router: Q4,
        gate: Q4,
        up: Q4,
        shared_gate: Q4,
        shared_up: Q4,
        logits: DevPtr<f32>,
        act: DevPtr<f32>,
        route_ids: DevPtr<i32>,
        route_w: DevPtr<f32>,
        route_ready: DevPtr<u32>,
    );
    /// `hidden += sum of route_w[k] * down_k act[k]` over the chosen experts and the gated shared one.
    experts_down(
        act: DevPtr<f32>,
        route_ids: DevPtr<i32>,
        route_w: DevPtr<f32>,
        route_ready: DevPtr<u32>,
        down: Q4,
        shared_down: Q4,
        hidden: DevPtr<f32>,
    );
}
