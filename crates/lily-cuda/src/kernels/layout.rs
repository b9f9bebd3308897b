//! Data moved on the GPU (kernels/layout.cu): the expert matrices tiled into the kernels' layouts, spans of sequence
//! state copied.

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
    /// Copies `count` spans, `spans` holding each one's (source address, destination address, bytes); the grid's y
    /// is at least `count`.
    copy_spans(spans: DevPtr<u64>, count: i32);
}
