//! lily's CUDA backend: the decode step and the prefill of Qwen3.5/3.6-35B-A3B on one NVIDIA GPU.
//!
//! [`model`] holds the whole decode step in order and [`prefill`] the whole pass over a prompt chunk; [`kernels`] compiles the `.cu` files and holds one typed launcher per kernel, beside its family; [`weights`] puts the 4-bit
//! weights on the GPU (from a checkpoint, or generated in place); [`selftest`] checks every kernel and the whole
//! model against the CPU backend; [`bench`] measures decode speed llama-bench's way.

pub mod bench;
pub mod cli;
pub mod driver;
pub mod gemm;
pub mod kernels;
pub mod launch;
pub mod model;
pub mod prefill;
pub mod prefill_attn;
pub mod prefill_gdn;
pub mod selftest;
pub mod timeline;
pub mod weights;

pub use model::{CudaBackend, CudaModel};
