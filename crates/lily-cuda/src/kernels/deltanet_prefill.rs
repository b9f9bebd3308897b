//! The prefill's Gated DeltaNet (kernels/deltanet_prefill.cu): chunk-parallel preparation, the sequential pass
//! over the chunks' states, and the gated norm of the output.

use half::{bf16, f16};

use super::signature::launchers;
use super::{KernelFile, Q8x2};
use crate::driver::DevPtr;

pub const FILE: KernelFile<'static> = KernelFile {
    name: "deltanet_prefill.cu",
    source: include_str!("../../kernels/deltanet_prefill.cu"),
    kernels: KERNELS,
    buffers: &[],
    constants: &[
        "deltanet_chunks_shared_bytes",
        "deltanet_state_shared_bytes",
        "deltanet_state_split",
        "deltanet_short_max_tokens",
        "deltanet_short_split",
    ],
};

launchers! {
    /// The conv, l2 norms, gates and each chunk's (I + A)^-1 and intra-chunk attention; the conv ring at `cut`
    /// (tokens into the call, 0 for none) into `cut_ring`, and at `cut2` into `cut_ring2`.
    deltanet_prefill_chunks(
        proj: DevPtr<f32>,
        t: i32,
        start: i32,
        ring: DevPtr<f32>,
        conv1d: DevPtr<f32>,
        a_log: DevPtr<f32>,
        dt_bias: DevPtr<f32>,
        q_out: DevPtr<f32>,
        k_out: DevPtr<f32>,
        v_out: DevPtr<f32>,
        decay_out: DevPtr<f32>,
        beta_out: DevPtr<f32>,
        inverse_out: DevPtr<f32>,
        attn_out: DevPtr<f32>,
        cut: i32,
        cut_ring: DevPtr<f32>,
        cut2: i32,
        cut_ring2: DevPtr<f32>,
    );
    /// The state carried through the chunks in order; each chunk's output over `v_o`; the state at `cut` (tokens
    /// into the call, 0 for none) into `cut_state`, and at `cut2` (in a later chunk) into `cut_state2`.
    deltanet_prefill_state(
        q: DevPtr<f32>,
        k: DevPtr<f32>,
        v_o: DevPtr<f32>,
        decay: DevPtr<f32>,
        beta: DevPtr<f32>,
        inverse: DevPtr<f32>,
        attn: DevPtr<f32>,
        t: i32,
        state: DevPtr<f16>,
        cut: i32,
        cut_state: DevPtr<f16>,
        cut2: i32,
        cut_state2: DevPtr<f16>,
    );
    /// For a call of at most `deltanet_short_max_tokens` tokens, in place of the two launches above: the conv,
    /// norms and gates, then the recurrence token by token; each token's output into `v_o` (as the state pass
    /// leaves it), the state updated, and at `cut` and `cut2` (0 for none) the state and ring into theirs.
    deltanet_prefill_short(
        proj: DevPtr<f32>,
        t: i32,
        start: i32,
        ring: DevPtr<f32>,
        conv1d: DevPtr<f32>,
        a_log: DevPtr<f32>,
        dt_bias: DevPtr<f32>,
        v_o: DevPtr<f32>,
        state: DevPtr<f16>,
        cut: i32,
        cut_state: DevPtr<f16>,
        cut_ring: DevPtr<f32>,
        cut2: i32,
        cut_state2: DevPtr<f16>,
        cut_ring2: DevPtr<f32>,
    );
    /// The gated norm of each head's output into bf16 `out`, also coded as the small tiling's Q8x2 rows unless
    /// `codes` is [`Q8x2::NONE`]; the conv ring left as decode would leave it.
    deltanet_prefill_norm(
        o: DevPtr<f32>,
        proj: DevPtr<f32>,
        norm_w: DevPtr<f32>,
        t: i32,
        start: i32,
        ring: DevPtr<f32>,
        out: DevPtr<bf16>,
        codes: Q8x2,
    );
}
