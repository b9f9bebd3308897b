//! Matrices rearranged on the GPU into the kernels' layouts (kernels/layout.cu): the expert matrices tiled.

use super::signature::launchers;
use super::KernelFile;
use crate::driver::DevPtr;

pub const FILE: KernelFile<'static> = KernelFile {
    name: "layout.cu",
    source: include_str!("../../kernels/layout.cu"),
    kernels: KERNELS,
    buffers: &[],
    constants: &["tiled_rows", "tiled_piece"],
};

launchers! {
    /// `dst` = `src` (`rows` rows of `row_words` words) tiled, `piece_words` words of a row to a piece.
    tile_rows(src: DevPtr<u32>, dst: DevPtr<u32>, rows: u64, row_words: i32, piece_words: i32);
}
