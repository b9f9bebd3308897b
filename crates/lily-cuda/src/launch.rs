//! Queuing kernels by name on the model's stream, optionally with CUDA events around each launch (per-kernel GPU
//! time for `lily bench --profile`).

use crate::driver::{Args, Event, Gpu, Result};
use crate::kernels::Kernels;

/// Per-kernel GPU time, from events around every launch of un-captured work: by kernel name (`entries`) and by
/// kernel name and grid (`shapes`, which tells one product's matrices from another's). A profile made by
/// [`Profile::names_only`] times nothing: it keeps the launches in order (`launched`), for a timeline to time.
#[derive(Default)]
pub struct Profile {
    pub entries: Vec<(&'static str, f64, usize)>,
    pub shapes: Vec<(Shape, f64, usize)>,
    pending: Vec<(Shape, Event, Event)>,
    names_only: bool,
    pub launched: Vec<Shape>,
}

/// A launch's kernel and grid.
pub type Shape = (&'static str, (u32, u32, u32));

/// Adds `ms` to the entry of `key`, or appends one.
fn add<K: PartialEq>(entries: &mut Vec<(K, f64, usize)>, key: K, ms: f64) {
    match entries.iter_mut().find(|e| e.0 == key) {
        Some(e) => {
            e.1 += ms;
            e.2 += 1;
        }
        None => entries.push((key, ms, 1)),
    }
}

impl Profile {
    /// A profile that only keeps the launches in order, leaving them as they run without it.
    pub fn names_only() -> Profile {
        Profile {
            names_only: true,
            ..Profile::default()
        }
    }

    /// Adds `ms` of a launch of `shape`, timed elsewhere.
    pub fn add_time(&mut self, shape: Shape, ms: f64) {
        add(&mut self.entries, shape.0, ms);
        add(&mut self.shapes, shape, ms);
    }

    /// Waits for the recorded launches and adds their times to `entries` and `shapes`.
    pub fn collect(&mut self) -> Result<()> {
        for (shape, start, end) in std::mem::take(&mut self.pending) {
            let ms = start.elapsed_ms(&end)? as f64;
            self.add_time(shape, ms);
        }
        Ok(())
    }

    /// The table of the collected times, by kernel, then the `shapes` longest (kernel, grid) pairs; each line
    /// starts with `indent`.
    pub fn report(&self, indent: &str, shapes: usize) -> String {
        use std::fmt::Write;
        let total: f64 = self.entries.iter().map(|e| e.1).sum();
        let mut out = String::new();
        let mut entries = self.entries.clone();
        entries.sort_by(|a, b| b.1.total_cmp(&a.1));
        for (name, ms, count) in entries {
            let share = 100.0 * ms / total;
            let _ = writeln!(out, "{indent}{name:<28} {ms:8.3} ms  {count:4} launches  {share:5.1}%");
        }
        let mut by_shape = self.shapes.clone();
        by_shape.sort_by(|a, b| b.1.total_cmp(&a.1));
        let _ = writeln!(out, "{indent}by grid:");
        for ((name, (x, y, z)), ms, count) in by_shape.into_iter().take(shapes) {
            let grid = format!("{x}x{y}x{z}");
            let each = 1e3 * ms / count as f64;
            let _ = writeln!(
                out,
                "{indent}{name:<28} {grid:>12} {ms:8.3} ms  {count:4} launches  {each:7.1} us each"
            );
        }
        out
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
            Some(p) if p.names_only => {
                p.launched.push((name, grid));
                launch(&mut args)
            }
            Some(p) => {
                let (start, end) = (self.gpu.event()?, self.gpu.event()?);
                self.gpu.record(&start)?;
                launch(&mut args)?;
                self.gpu.record(&end)?;
                p.pending.push(((name, grid), start, end));
                Ok(())
            }
        }
    }
}
