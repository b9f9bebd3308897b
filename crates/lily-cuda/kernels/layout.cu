// Data moved on the GPU: the expert matrices rearranged into the layouts the kernels read (tiled; see common.cuh),
// and spans of sequence state copied.

// Read by the host (src/weights.rs checks them against its own).
__device__ int tiled_rows = TILED_ROWS;
__device__ int tiled_piece = TILED_PIECE;

// dst = src tiled: `rows` rows of `row_words` words (packed codes, or (scale, bias) pairs), `piece_words` words of
// a row to a piece (TILED_PIECE_WORDS or TILED_PIECE_PAIRS). Word w of row r goes to its block's piece w /
// piece_words, after the piece's earlier rows. `rows` is a multiple of TILED_ROWS, `row_words` of `piece_words`.
extern "C" __global__ void tile_rows(const u32* src, u32* dst, u64 rows, int row_words, int piece_words) {
    wait_previous();
    const u64 n = rows * row_words;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const u64 r = i / row_words;
        const int w = (int)(i % row_words);
        const u64 block = r / TILED_ROWS;
        const int in_block = (int)(r % TILED_ROWS);
        dst[block * TILED_ROWS * row_words + (u64)(w / piece_words) * TILED_ROWS * piece_words +
            in_block * piece_words + w % piece_words] = src[i];
    }
}

// Copies on the device in one launch: `spans` holds `count` (source, destination, bytes) triples, and block (x, y)
// copies its share of span y, 16 bytes a thread at a time where the span's ends and length allow, else a byte. The
// spans must not overlap.
extern "C" __global__ void copy_spans(const u64* spans, int count) {
    wait_previous();
    if ((int)blockIdx.y >= count) return;
    const u64 from = spans[3 * blockIdx.y], to = spans[3 * blockIdx.y + 1], bytes = spans[3 * blockIdx.y + 2];
    const u64 first = blockIdx.x * (u64)blockDim.x + threadIdx.x, stride = (u64)gridDim.x * blockDim.x;
    if (((from | to | bytes) & 15) == 0) {
        const uint4* src = (const uint4*)from;
        uint4* dst = (uint4*)to;
        for (u64 i = first; i < bytes / 16; i += stride) dst[i] = src[i];
    } else {
        const unsigned char* src = (const unsigned char*)from;
        unsigned char* dst = (unsigned char*)to;
        for (u64 i = first; i < bytes; i += stride) dst[i] = src[i];
    }
}
