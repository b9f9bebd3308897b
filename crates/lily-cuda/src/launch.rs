//! Queuing kernels by name on the model's stream, optionally with CUDA events around each launch (per-kernel GPU
//! time for `lily bench --profile`).

use crate::driver::{Args, Event, Gpu, Result};
use crate::kernels::Kernels;

/// Per-kernel GPU time, from events around every launch of un-captured work.
#[derive(Default)]
pub struct Profile {
    pub entries: Vec<(&'static str, f64, usize)>,
    pending: Vec<(&'static str, Event, Event)>,
}

impl Profile {
    /// Waits for the recorded launches and adds their times to `entries`, by kernel name.
    pub fn collect(&mut self) -> Result<()> {
        for (name, start, end) in std::mem::take(&mut self.pending) {
            let ms = start.elapsed_ms(&end)? as f64;
            match self.entries.iter_mut().find(|e| e.0 == name) {
                Some(e) => {
                    e.1 += ms;
                    e.2 += 1;
                }
                None => self.entries.push((name, ms, 1)),
            }
        }
        Ok(())
    }
}

/// A launch's geometry: the grid, the threads of a block (one dimension) and its dynamic shared memory in bytes.
#[derive(Clone, Copy, Debug)]
pub struct Dims {
    pub grid: (u32, u32, u32),
    pub block: u32,
    pub shared: u32,
}

impl Dims {
    /// `grid` blocks of `block` threads, no dynamic shared memory.
    pub fn new(grid: (u32, u32, u32), block: u32) -> Dims {
        Dims { grid, block, shared: 0 }
    }

    /// A one-dimensional grid of `blocks` blocks of `block` threads.
    pub fn linear(blocks: u32, block: u32) -> Dims {
        Dims::new((blocks, 1, 1), block)
    }

    /// The same with `bytes` of dynamic shared memory per block.
    pub fn shared(self, bytes: u32) -> Dims {
        Dims { shared: bytes, ..self }
    }
}

/// Queues kernels on the GPU's stream; the typed launchers of [`crate::kernels`] go through it.
pub struct Launcher<'a> {
    pub gpu: &'a Gpu,
    pub kernels: &'a Kernels,
    pub profile: Option<&'a mut Profile>,
}

impl<'a> Launcher<'a> {
    /// A launcher without profiling.
    pub fn new(gpu: &'a Gpu, kernels: &'a Kernels) -> Launcher<'a> {
        Launcher {
            gpu,
            kernels,
            profile: None,
        }
    }

    /// Queues kernel `name` with `args` (called by the typed launchers only).
    pub(crate) fn launch(&mut self, name: &'static str, dims: Dims, args: Args) -> Result<()> {
        let Dims { grid, block, shared } = dims;
        let mut args = args;
        let kernel = self.kernels.get(name);
        let gpu = self.gpu;
        let launch = |args: &mut Args| gpu.launch(kernel, grid, block, shared, args);
        match self.profile.as_deref_mut() {
            None => launch(&mut args),
            Some(p) => {
                let (start, end) = (self.gpu.event()?, self.gpu.event()?);
                self.gpu.record(&start)?;
                launch(&mut args)?;
                self.gpu.record(&end)?;
                p.pending.push((name, start, end));
                Ok(())
            }
        }
    }
}
