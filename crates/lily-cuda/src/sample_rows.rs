//! The host side of the batched sampler (`sample_rows` in kernels/sampling.cu): the device arrays of per-row
//! parameters and allowed-token masks, and the chosen tokens in pinned host memory.
//!
//! A row draws on the GPU exactly as `lily_model::sampling::Sampler` would on the host when [`on_device`] holds
//! (greedy, a top-k of at most `lily_model::sampling::HEAD`, or no top-k); for other parameters (a larger top-k) the
//! caller copies the row's logits out and samples it on the host. A row with a top-p or min-p but no top-k whose
//! kept tokens run past the GPU's head of candidates (`lily_model::sampling::HEAD`, rare: a nearly flat softmax)
//! comes back as `u32::MAX`: the caller gives the draw back (`Sampler::return_draw`) and samples it on the host.

use lily_model::sampling::{SamplingParams, HEAD};

use crate::driver::{DevBuf, DevPtr, Gpu, GpuError, HostBuf, Result};
use crate::kernels::sampling::{self, RowParams};
use crate::launch::{Dims, Launcher};

/// Whether `sample_rows` takes a row with `params`: it draws it as the host `Sampler` would, or (a top-p or min-p
/// past its head) leaves it to the host with `u32::MAX`.
pub fn on_device(params: &SamplingParams) -> bool {
    params.is_greedy() || (0..=HEAD).contains(&params.top_k)
}

/// The batched sampler's buffers for up to `max_rows` rows of `vocab` logits.
pub struct SampleRows {
    max_rows: usize,
    vocab: usize,
    params: DevBuf<RowParams>,
    /// `[max_rows][vocab / 32 rounded up]` allowed-token bitmasks, one per masked row of the last `enqueue`.
    masks: DevBuf<u32>,
    out: HostBuf,
    /// Rows of the last `enqueue`.
    rows: usize,
    staged_params: Vec<RowParams>,
    staged_masks: Vec<u32>,
}

impl SampleRows {
    pub fn new(gpu: &Gpu, max_rows: usize, vocab: usize) -> Result<SampleRows> {
        let max_rows = max_rows.max(1);
        let words = vocab.div_ceil(32);
        Ok(SampleRows {
            max_rows,
            vocab,
            params: gpu.alloc_zeroed(max_rows)?,
            masks: gpu.alloc_zeroed(max_rows * words)?,
            out: gpu.host_buf(max_rows)?,
            rows: 0,
            staged_params: Vec::with_capacity(max_rows),
            staged_masks: Vec::with_capacity(max_rows * words),
        })
    }

    /// The most rows one `enqueue` takes.
    pub fn max_rows(&self) -> usize {
        self.max_rows
    }

    /// Queues the draw of one token for each of `rows`, row `i` from logits row `rows[i].logits_row` of `logits`
    /// (`[*][vocab]`; rows may share one, as the choices of a request do) among the tokens `masks[i]` allows when given (bit `t % 32` of word `t / 32`, the format of
    /// `lily_model::backend::Pick::allowed`; tokens past a short mask's end are not allowed). `masks` is empty
    /// (no masks) or has one entry per row; each row's `mask_row` is set here. The parameters and masks are copied
    /// before this returns; the tokens are ready for [`SampleRows::read`] once the stream has been synchronised.
    pub fn enqueue(
        &mut self,
        l: &mut Launcher,
        logits: DevPtr<f32>,
        rows: &[RowParams],
        masks: &[Option<&[u32]>],
    ) -> Result<()> {
        self.stage(l.gpu, rows, masks)?;
        self.launch(l, logits, rows.len())
    }

    /// The first half of [`SampleRows::enqueue`]: queues the copies of the rows' parameters and masks to the
    /// device (from host memory that may be reused once this returns). Not for stream capture.
    pub fn stage(&mut self, gpu: &Gpu, rows: &[RowParams], masks: &[Option<&[u32]>]) -> Result<()> {
        if rows.is_empty() || rows.len() > self.max_rows {
            return Err(GpuError::Other(format!(
                "sample_rows takes 1 to {} rows, not {}",
                self.max_rows,
                rows.len()
            )));
        }
        if !masks.is_empty() && masks.len() != rows.len() {
            return Err(GpuError::Other(format!(
                "sample_rows got {} masks for {} rows",
                masks.len(),
                rows.len()
            )));
        }
        let words = self.vocab.div_ceil(32);
        self.staged_params.clear();
        self.staged_masks.clear();
        for (i, row) in rows.iter().enumerate() {
            if row.logits_row < 0 {
                return Err(GpuError::Other(format!(
                    "sample_rows: row {i} names logits row {}",
                    row.logits_row
                )));
            }
            let mut row = *row;
            row.mask_row = -1;
            if let Some(Some(mask)) = masks.get(i) {
                row.mask_row = (self.staged_masks.len() / words) as i32;
                let n = mask.len().min(words);
                self.staged_masks.extend_from_slice(&mask[..n]);
                self.staged_masks.resize(self.staged_masks.len() + words - n, 0);
            }
            self.staged_params.push(row);
        }
        gpu.upload_async(self.params.ptr(), &self.staged_params)?;
        if !self.staged_masks.is_empty() {
            gpu.upload_async(self.masks.ptr(), &self.staged_masks)?;
        }
        Ok(())
    }

    /// The second half of [`SampleRows::enqueue`]: queues the kernel over the first `rows` staged rows (a fixed
    /// launch, which a CUDA graph may capture).
    pub fn launch(&mut self, l: &mut Launcher, logits: DevPtr<f32>, rows: usize) -> Result<()> {
        if rows == 0 || rows > self.max_rows {
            return Err(GpuError::Other(format!(
                "sample_rows takes 1 to {} rows, not {rows}",
                self.max_rows
            )));
        }
        self.rows = rows;
        sampling::sample_rows(
            l,
            Dims::linear(rows as u32, 1024),
            logits,
            self.params.ptr(),
            self.masks.ptr(),
            self.out.ptr,
        )
    }

    /// The token of each row of the last `enqueue` (call after synchronising the stream); `u32::MAX` for a row
    /// left to the host: its parameters are not [`on_device`], or what its top-p or min-p keeps runs past the head.
    pub fn read(&self) -> Vec<u32> {
        (0..self.rows).map(|i| self.out.read(i) as u32).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::on_device;
    use lily_model::sampling::{SamplingParams, HEAD};

    #[test]
    fn the_gpu_draws_top_k_rows_up_to_the_host_samplers_head() {
        let sampled = |top_k| SamplingParams {
            temperature: 1.0,
            top_k,
            ..Default::default()
        };
        assert!(on_device(&SamplingParams::default()), "greedy");
        for top_k in [0, 1, 64, 65, 200, HEAD] {
            assert!(on_device(&sampled(top_k)), "top_k {top_k}");
        }
        assert!(!on_device(&sampled(HEAD + 1)), "a top_k past the head goes to the host");
        // A top-k of 1 is greedy whatever the temperature.
        assert!(on_device(&SamplingParams {
            top_k: 1,
            temperature: 2.0,
            ..Default::default()
        }));
    }
}
