//! The CPU backend: the reference every GPU kernel is tested against, and the product's fallback.
//! The whole forward pass, in order, is in [`model`].

pub mod attention;
mod decode;
pub mod deltanet;
pub mod gemm;
pub mod linalg;
pub mod model;
pub mod moe;
pub mod numerics;
pub mod simd;
pub mod team;

pub use decode::DecodeRow;
pub use model::{CpuModel, State};
