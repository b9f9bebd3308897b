//! The head (kernels/sampling.cu): the final norm and lm_head with the greedy choice, and the sampler of a batch's
//! rows with its per-row parameters.

use lily_model::sampling::SamplingParams;

use super::signature::{launchers, DeviceType};
use super::{KernelFile, Q4};
use crate::driver::DevPtr;

pub const FILE: KernelFile<'static> = KernelFile {
    name: "sampling.cu",
    source: include_str!("../../kernels/sampling.cu"),
    kernels: KERNELS,
    buffers: &[],
    constants: &[],
};

/// One row's sampling parameters as `sample_rows` reads them: the twin of sampling.cu's `SampleRow` (40 bytes,
/// every field at the offset the C rules give it, no hidden padding).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RowParams {
    /// 0 for a greedy row (whenever [`SamplingParams::is_greedy`] holds).
    pub temperature: f32,
    pub top_k: i32,
    pub top_p: f32,
    pub min_p: f32,
    pub seed: u64,
    /// The draw's index in the sequence's random stream (see `Sampler::next_draw`); the kernel's uniform is
    /// `uniform_at(seed, 0, counter)`.
    pub counter: u64,
    /// The row of the mask buffer that allows this row's tokens, or -1 for none.
    pub mask_row: i32,
    /// The row of the logits this row draws from.
    pub logits_row: i32,
}

// Plain old data: only integers and floats, and no padding (see the layout test).
unsafe impl bytemuck::Zeroable for RowParams {}
unsafe impl bytemuck::Pod for RowParams {}

impl DeviceType for RowParams {
    const C_NAME: &'static str = "SampleRow";
}

impl RowParams {
    /// The row for `params`, drawing the sequence's draw number `counter` (unused when greedy) from logits row 0,
    /// without a mask.
    pub fn new(params: &SamplingParams, counter: u64) -> RowParams {
        RowParams {
            temperature: if params.is_greedy() { 0.0 } else { params.temperature },
            top_k: params.top_k.min(i32::MAX as usize) as i32,
            top_p: params.top_p,
            min_p: params.min_p,
            seed: params.seed,
            counter,
            mask_row: -1,
            logits_row: 0,
        }
    }
}

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
    /// One block per row `r` of `rows`: the token drawn from logits row `rows[r].logits_row` (`logits` is
    /// `[*][vocab]`) among the tokens its mask row of `masks` allows, into `out[r]` (-1 for a row the host samples;
    /// see `sample_rows::on_device`).
    sample_rows(
        logits: DevPtr<f32>,
        rows: DevPtr<RowParams>,
        masks: DevPtr<u32>,
        out: DevPtr<i32>,
    );
}

#[cfg(test)]
mod tests {
    use std::mem::{align_of, offset_of, size_of};

    use super::*;

    /// The offsets sampling.cu's `SampleRow` has by the C rules (each field at the next multiple of its alignment):
    /// four 4-byte fields, two u64 from 16, the mask row at 32, 40 bytes in all at an 8-byte alignment.
    #[test]
    fn row_params_match_the_kernel_struct() {
        assert_eq!(size_of::<RowParams>(), 40);
        assert_eq!(align_of::<RowParams>(), 8);
        let offsets = [
            offset_of!(RowParams, temperature),
            offset_of!(RowParams, top_k),
            offset_of!(RowParams, top_p),
            offset_of!(RowParams, min_p),
            offset_of!(RowParams, seed),
            offset_of!(RowParams, counter),
            offset_of!(RowParams, mask_row),
            offset_of!(RowParams, logits_row),
        ];
        assert_eq!(offsets, [0, 4, 8, 12, 16, 24, 32, 36]);
        // The struct's field list in the kernel source is the one these offsets describe.
        let source = FILE.source;
        let start = source.find("struct SampleRow {").expect("SampleRow in sampling.cu");
        let body = &source[start..start + source[start..].find("};").expect("end of SampleRow")];
        let fields: Vec<&str> = body
            .lines()
            .skip(1)
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with("//"))
            .collect();
        assert_eq!(
            fields,
            [
                "float temperature;",
                "int top_k;",
                "float top_p;",
                "float min_p;",
                "u64 seed;",
                "u64 counter;",
                "int mask_row;",
                "int logits_row;"
            ]
        );
    }

    #[test]
    fn greedy_parameters_send_temperature_zero() {
        let greedy_by_top_k = SamplingParams {
            temperature: 0.7,
            top_k: 1,
            ..Default::default()
        };
        assert_eq!(RowParams::new(&greedy_by_top_k, 3).temperature, 0.0);
        let sampled = SamplingParams {
            temperature: 0.7,
            top_k: 20,
            top_p: 0.9,
            min_p: 0.05,
            seed: 11,
        };
        let row = RowParams::new(&sampled, 3);
        assert_eq!(
            (row.temperature, row.top_k, row.counter, row.mask_row),
            (0.7, 20, 3, -1)
        );
        let unlimited = SamplingParams {
            top_k: usize::MAX,
            ..sampled
        };
        assert_eq!(RowParams::new(&unlimited, 1).top_k, i32::MAX);
    }
}
