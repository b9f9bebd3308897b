//! Where a pass's time goes, kernel by kernel, as it runs (`lily bench --timeline`): the captured decode step, and
//! a prompt's prefill. Kernels compiled with `-DLILY_TIMELINE` note the global clock when their wait for the
//! previous kernel returns (see `wait_previous` in common.cuh); the time from one kernel's wait to the next one's is
//! what that kernel adds to the pass: its work after the wait, then the launch boundary. CUDA events around each
//! launch (`--profile`) cannot see this: they keep kernels from overlapping, and inside a graph there are none.

use lily_model::backend::Backend;
use lily_model::config::LayerKind;

use crate::driver::{DevBuf, GpuError, Result};
use crate::launch::{Profile, Shape};
use crate::model::{CudaBackend, Op};

/// Slots of the device buffer (`TIMELINE_SLOTS` in common.cuh).
const SLOTS: usize = 1 << 16;

/// A kernel that waits again takes another slot, with its launch's grid id; such a slot is dropped if a launch
/// among the last `REPEATS_WITHIN` kept has the same id (a later launch may reuse an id, but not that soon).
const REPEATS_WITHIN: usize = 4;

pub struct Timeline {
    /// A u32 count of slots taken, then SLOTS u64 clock readings, then SLOTS u64 grid ids.
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
        let buf = model.gpu.alloc_zeroed(1 + 2 * SLOTS)?;
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
        let at = self.launches(backend)?;
        let expected = tokens.len() * per_step;
        if at.len() != expected {
            return Err(GpuError::Other(format!(
                "the timeline has {} launches where {expected} were expected",
                at.len()
            )));
        }
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

    /// Prefills `ids` after the `depth` positions the sequence holds, with no synchronisation inside the pass,
    /// and returns what each launch adds to it (times in ms, by kernel and grid) and the pass's span in ms, from
    /// the first kernel's wait to the last one's. The last launch has no next one to close it: it is left out and
    /// returned apart.
    pub fn measure_prefill(
        &self,
        backend: &mut CudaBackend,
        depth: usize,
        ids: &[u32],
    ) -> Result<(Profile, f64, Shape)> {
        let model = &backend.model;
        model.gpu.upload(model.state.tokens.at(depth).cast::<u32>(), ids)?;
        model.gpu.memset_u8(self.buf.ptr(), 0, 8)?;
        model.gpu.sync()?;
        let mut launched = Profile::names_only();
        model.enqueue_prefill(depth, ids.len(), Some(&mut launched))?;
        model.gpu.sync()?;
        let at = self.launches(backend)?;
        let shapes = std::mem::take(&mut launched.launched);
        if at.len() != shapes.len() || at.len() < 2 {
            return Err(GpuError::Other(format!(
                "the timeline has {} launches where the prefill made {}",
                at.len(),
                shapes.len()
            )));
        }
        let mut profile = Profile::default();
        for (i, shape) in shapes.iter().enumerate().take(shapes.len() - 1) {
            profile.add_time(*shape, (at[i + 1] - at[i]) as f64 / 1e6);
        }
        let span = (at[at.len() - 1] - at[0]) as f64 / 1e6;
        Ok((profile, span, shapes[shapes.len() - 1]))
    }

    /// The clock reading of each launch since the count was cleared, in launch order: each launch's first slot
    /// (see [`REPEATS_WITHIN`]).
    fn launches(&self, backend: &CudaBackend) -> Result<Vec<u64>> {
        let gpu = &backend.model.gpu;
        let mut count = [0u32];
        gpu.download(self.buf.ptr().cast::<u32>(), &mut count)?;
        let taken = count[0] as usize;
        if taken > SLOTS {
            return Err(GpuError::Other(format!(
                "the timeline holds {SLOTS} slots; {taken} were taken"
            )));
        }
        let (mut at, mut grid) = (vec![0u64; taken], vec![0u64; taken]);
        gpu.download(self.buf.at(1), &mut at)?;
        gpu.download(self.buf.at(1 + SLOTS), &mut grid)?;
        Ok(first_of_each_launch(&at, &grid))
    }
}

/// The readings `at` of the slots, the grid ids `grid` beside them, less each slot whose id one of the last
/// [`REPEATS_WITHIN`] slots kept has: a launch's later waits.
fn first_of_each_launch(at: &[u64], grid: &[u64]) -> Vec<u64> {
    let mut kept: Vec<(u64, u64)> = Vec::with_capacity(at.len());
    for (&t, &g) in at.iter().zip(grid) {
        let from = kept.len().saturating_sub(REPEATS_WITHIN);
        if !kept[from..].iter().any(|&(_, kept_grid)| kept_grid == g) {
            kept.push((t, g));
        }
    }
    kept.into_iter().map(|(t, _)| t).collect()
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

#[cfg(test)]
mod tests {
    use super::first_of_each_launch;

    #[test]
    fn a_launch_that_waits_again_keeps_its_first_reading() {
        // Launch 7 waits three times, the second after launch 8 took its slot; launch 9 once.
        let at = [10, 20, 25, 30, 40];
        let grid = [7, 8, 7, 9, 7];
        assert_eq!(first_of_each_launch(&at, &grid), vec![10, 20, 30]);
        // Id 7 again after four other launches is a new launch (which then waits twice).
        let at: Vec<u64> = (0..7).collect();
        let grid = [7, 10, 11, 12, 13, 7, 7];
        assert_eq!(first_of_each_launch(&at, &grid), vec![0, 1, 2, 3, 4, 5]);
    }
}
