//! lily's model: configuration, checkpoint loading, synthetic weights, and the CPU backend.

pub mod backend;
pub mod batch;
pub mod checkpoint;
pub mod config;
pub mod cpu;
pub mod default_model;
pub mod derived;
pub mod quant;
pub mod rng;
pub mod sampling;
pub mod synth;
pub mod weights;

pub use backend::{Backend, BatchBackend, CpuBackend, ForwardError, Pick, PrefillPart, Slot, SnapshotId, StepRow};
pub use batch::{CpuBatchBackend, SingleSlot};
pub use config::Config;
pub use weights::Weights;
