//! lily's CUDA backend: the decode step and the prefill of Qwen3.5/3.6-35B-A3B on one NVIDIA GPU.
//!
//! The forward pass: [`model`] holds the decode step in order and [`prefill`] the pass over a prompt chunk (its
//! matrix products in [`gemm`], its mixers in [`prefill_attention`] and [`prefill_deltanet`]); [`kernels`] compiles the `.cu`
//! files and holds one typed launcher per kernel, beside its family; [`driver`] and [`launch`] are the few CUDA
//! calls and the launch path; [`weights`] puts the 4-bit weights on the GPU (from a checkpoint, or generated in
//! place); [`pages`] keeps the host's account of the paged KV pool shared by the sequence slots. Apart from the forward pass: [`selftest`] checks every kernel and the whole model against the CPU
//! backend, one file per kernel family; [`bench`] measures speed llama-bench's way.
//! [`sample_rows`] is the host side of the sampler of a batch's rows.

pub mod batch;
pub mod bench;
pub mod driver;
pub mod gemm;
pub mod kernels;
pub mod launch;
pub mod model;
pub mod pages;
pub mod prefill;
pub mod prefill_attention;
pub mod prefill_deltanet;
pub mod sample_rows;
pub mod selftest;
pub mod weights;

pub use model::{CudaBackend, CudaModel};
