//! The decode step's Gated DeltaNet (kernels/deltanet.cu): the causal conv over the ring of recent inputs, the
//! gates and the delta-rule update of the recurrent state, for one token.

use super::signature::launchers;
use super::KernelFile;
use crate::driver::DevPtr;

pub const FILE: KernelFile<'static> = KernelFile {
    name: "deltanet.cu",
    source: include_str!("../../kernels/deltanet.cu"),
    kernels: KERNELS,
    constants: &[],
};

launchers! {
    /// One token through the mixer: `proj` (q k v z b a) in, `ring` and `state` updated, `core` out.
    deltanet_step(
        position: DevPtr<i32>,
        proj: DevPtr<f32>,
        ring: DevPtr<f32>,
        conv1d: DevPtr<f32>,
        a_log: DevPtr<f32>,
        dt_bias: DevPtr<f32>,
        state: DevPtr<f32>,
        core: DevPtr<f32>,
    );
}
