//! Where the captured decode step's time goes, kernel by kernel, as it runs (`lily bench --timeline`). Kernels
//! compiled with `-DLILY_TIMELINE` note the global clock when their wait for the previous kernel returns (see
//! `wait_previous` in common.cuh); the time from one kernel's wait to the next one's is what that kernel adds to
//! the step: its work after the wait, then the launch boundary. CUDA events around each launch (`--profile`)
//! cannot see this inside a graph, where kernels overlap.

use lily_model::backend::Backend;
use lily_model::config::LayerKind;

use crate::driver::{DevBuf, GpuError, Result};
use crate::model::{CudaBackend, Op};

/// Slots of the device buffer (`TIMELINE_SLOTS` in common.cuh).
const SLOTS: usize = 1 << 16;

pub struct Timeline {
    /// A u32 count of entries, then up to SLOTS u64 clock readings.
    buf: DevBuf<u64>,
}

/// One kind of kernel: launches a step and the mean time it adds to a step.
pub struct Entry {
    pub kernel: String,
    pub launches: usize,
    pub us_per_step: f64,
}

impl Timeline {
    /// Needs a model whose kernels were loaded after [`crate::kernels::enable_timeline`].
    pub fn attach(backend: &CudaBackend) -> Result<Timeline> {
        let model = &backend.model;
        let buf = model.gpu.alloc_zeroed(1 + SLOTS)?;
        model.kernels.attach_timeline(&model.gpu, buf.ptr())?;
        Ok(Timeline { buf })
    }

    /// Decodes `tokens` one at a time (synchronising after each, as the benchmark does) and returns, per kind of
    /// kernel, the time it adds to a step; the head's entry includes the host's round trip to the next step.
    pub fn measure(&self, backend: &mut CudaBackend, tokens: &[u32]) -> Result<Vec<Entry>> {
        let mut ops = backend.model.layer_ops();
        ops.push(Op::LmHead);
        let per_step = ops.len();
        if tokens.len() < 2 || tokens.len() * per_step > SLOTS {
            return Err(GpuError::Other(format!(
                "the timeline takes 2 to {} tokens",
                SLOTS / per_step
            )));
        }
        let gpu = &backend.model.gpu;
        gpu.memset_u8(self.buf.ptr(), 0, 8)?;
        gpu.sync()?;
        for &t in tokens {
            backend.decode(t).map_err(|e| GpuError::Other(e.to_string()))?;
            backend.read_next_token()?;
        }
        let gpu = &backend.model.gpu;
        let mut count = [0u32];
        gpu.download(self.buf.ptr().cast::<u32>(), &mut count)?;
        let expected = tokens.len() * per_step;
        if count[0] as usize != expected {
            return Err(GpuError::Other(format!(
                "the timeline has {} entries where {expected} were expected",
                count[0]
            )));
        }
        let mut at = vec![0u64; expected];
        gpu.download(self.buf.at(1), &mut at)?;
        // The last step has no next kernel to close its head.
        let steps = tokens.len() - 1;
        let mut entries: Vec<Entry> = Vec::new();
        for (i, op) in ops.iter().enumerate() {
            let kernel = self::label(backend, *op);
            let ns: u64 = (0..steps)
                .map(|s| at[s * per_step + i + 1] - at[s * per_step + i])
                .sum();
            let us = ns as f64 / steps as f64 / 1e3;
            match entries.iter_mut().find(|e| e.kernel == kernel) {
                Some(e) => {
                    e.launches += 1;
                    e.us_per_step += us;
                }
                None => entries.push(Entry {
                    kernel,
                    launches: 1,
                    us_per_step: us,
                }),
            }
        }
        entries.sort_by(|a, b| b.us_per_step.total_cmp(&a.us_per_step));
        Ok(entries)
    }
}

fn label(backend: &CudaBackend, op: Op) -> String {
    let kind = |l: usize| backend.model.config.layer_types[l];
    match op {
        Op::Embed => "embed".into(),
        Op::MixerInProj(l) if kind(l) == LayerKind::Full => "proj_normed (attention)".into(),
        Op::MixerInProj(_) => "proj_normed (DeltaNet)".into(),
        Op::DeltaNetStep(_) => "deltanet_step".into(),
        Op::DeltaNetOutProj(_) => "out_proj_deltanet".into(),
        Op::AttnPrep(_) => "attn_prep".into(),
        Op::AttnPartial(_) => "attn_partial".into(),
        Op::AttnMerge(_) => "attn_merge".into(),
        Op::AttnOutProj(_) => "out_proj_attn".into(),
        Op::ExpertsGateUp(_) => "experts_gate_up".into(),
        Op::ExpertsDown(_) => "experts_down".into(),
        Op::AdvancePosition => "advance_position".into(),
        Op::LmHead => "lm_head, then the host's round trip".into(),
    }
}
