// Prefill matrix products on the tensor cores: bf16 activations times MLX-quantized weight rows (4-bit or 8-bit),
// mma.sync m16n8k16 with f32 accumulation. The weights are read packed, as the decode kernels
// read them; each warp dequantizes its own slice straight into mma B fragments (no dequantized copy anywhere).
//
// Tiling. A block of 8 warps computes BM activation rows (128, or 64 for small m and the MoE tiles) against
// 256 weight rows. Every warp takes all BM rows and 32 weight rows (4 n8 fragments: a warp tile of BM x 32),
// so no weight is dequantized twice in a block and a warp's A fragments serve 4 mma each. The k loop steps
// by 64 inputs, one quantization group, so each weight row has one scale/bias pair per step. A 4-stage
// cp.async pipeline brings per step: the A tile (BM x 64 bf16, 128-byte rows whose 16-byte chunks are XOR-
// swizzled by row so ldmatrix.x4 is conflict-free), the packed weight tile (256 rows x 32 bytes at 4 bits,
// each row's 16-byte chunks swizzled so the 8 rows a warp reads at once hit different banks) and the 256
// scale/bias pairs; one barrier per step. Thread i copies weight row i, so a warp copies the rows it uses.
//
// Dequantization (4-bit). Lane (g, t) of an mma B fragment holds row g's weights at k = 2t, 2t+1 (and
// 2t+8, 2t+9): byte t of a packed word. The byte's nibbles go to the two bf16 halves (a byte permute with the
// word shifted by 4, a mask-or with 0x4300 = bf16 128.0, so each half is exactly 128 + q), then two bf16x2
// FMAs: x * 1 - 128 = q exactly, and scale * q + bias rounded once. The tensor cores thus see each weight
// rounded to bf16 (relative error <= 2^-9), the activations exactly, and sum in f32.
// 8-bit (the router, 257 rows): the weights are formed in f32 (exact), split into bf16 hi + lo parts and
// multiplied twice, so the products are exact to f32 for the bf16 activations they are given (the prefill gives
// the router's input as two bf16 parts, two products); twice the tensor work of a small product.
//
// Occupancy: the dense kernels run one block (8 warps) per SM with up to 255 registers a thread (a 128 x 32
// warp tile is 128 f32 accumulators) and 4 x 25 KB of shared memory (q4, BM = 128); the MoE kernels two blocks
// per SM (64 x 32 warp tiles, 128 registers, 4 x 17 KB), so one block's barrier wait overlaps the other's work.
//
// Row tiles. Fragments of 16 rows past a tile's valid rows are skipped (warp-uniform), so a MoE tile holding
// 16 of its 64 rows costs a quarter of the products (the dequantization is paid in full). Partial tiles are
// zero-filled by cp.async (src-size 0) and masked at the store; nothing out of bounds is read or written.
// Dense products: the host picks BM = 64 or 128 and launches ceil(m / BM) row blocks; the kernel infers BM
// from gridDim.y (the two counts differ for every m > 64, and the host takes 64 for m <= 64).

#define KT 64                           // inputs per k step: one quantization group
#define GEMM_WARPS 8
#define GEMM_THREADS (GEMM_WARPS * WARP)
#ifndef GEMM_STAGES
#define GEMM_STAGES 4
#endif
#define WROWS (GEMM_WARPS * 32)         // weight rows per block tile
#define MOE_TILE_ROWS 64

static_assert(HIDDEN % KT == 0 && MOE_INTER % KT == 0, "products run over whole quantization groups");
static_assert(MOE_INTER % (WROWS / 2) == 0, "a gate/up block takes 128 columns of gate and of up");

// Column blocks of the grouped products: a gate/up block takes 128 columns of gate and of up, a down block 256.
constexpr int MOE_GATE_UP_COLS = MOE_INTER / (WROWS / 2);
constexpr int MOE_DOWN_COLS = (HIDDEN + WROWS - 1) / WROWS;

// Read by the host (the constants of src/kernels/gemm.rs).
__device__ int moe_tile_rows = MOE_TILE_ROWS;
__device__ int gemm_stages = GEMM_STAGES;
__device__ int moe_gate_up_col_blocks = MOE_GATE_UP_COLS;
__device__ int moe_down_col_blocks = MOE_DOWN_COLS;

// BM activation rows x WROWS weight rows of NMAT matrices (gate/up: NMAT = 2, each warp 16 columns of each),
// GROUPS quantization groups (k steps of KT inputs) per pipeline stage, STAGES stages. A stage holds GROUPS
// sub-stages of A (BM x 64 bf16 each) and of B (256 rows x 64 codes each), then the 256 rows' GROUPS scale/bias
// pairs row by row; with GROUPS = 1 that is one k step's A tile, B tile and scale/bias pairs.
// TILED: the weights are a tiled matrix (common.cuh), whose piece is a stage of two groups.
template <int BM_, int NMAT_, int BITS_, int GROUPS_ = 1, int STAGES_ = GEMM_STAGES, bool TILED_ = false>
struct Tile {
    static constexpr int BM = BM_, NMAT = NMAT_, BITS = BITS_, GROUPS = GROUPS_, STAGES = STAGES_;
    static constexpr bool TILED = TILED_;
    static constexpr int MF = BM / 16;                      // m16 fragments, all in every warp
    static constexpr int WCOLS = 32 / NMAT;                 // output columns per warp
    static constexpr int BN = GEMM_WARPS * WCOLS;           // output columns per block
    static constexpr int B_CHUNKS = BITS / 2;               // 16-byte chunks of a row's 64 codes
    static constexpr int STEPS_PER_CHUNK = 4 / B_CHUNKS;    // k16 steps one chunk covers
    static constexpr int A_SUB = BM * KT * 2;
    static constexpr int B_SUB = WROWS * 16 * B_CHUNKS;
    static constexpr int A_BYTES = GROUPS * A_SUB;
    static constexpr int B_BYTES = GROUPS * B_SUB;
    static constexpr int STAGE = A_BYTES + B_BYTES + WROWS * 4 * GROUPS;
    static constexpr int SMEM = STAGES * STAGE;             // the host's shared_bytes() mirrors this
    // 16-byte A chunks a thread copies per group (BM = 16: the first half of the threads copy one each).
    static constexpr int A_COPIES = (BM * 8 + GEMM_THREADS - 1) / GEMM_THREADS;
    static constexpr int B_ROW_CHUNKS = GROUPS * B_CHUNKS;  // 16-byte chunks of a weight row per stage
    static constexpr int B_COPIES = WROWS * B_ROW_CHUNKS / GEMM_THREADS;  // (GROUPS > 1) chunks a thread copies
    static_assert(BM % 16 == 0 && ((BM * 8) % GEMM_THREADS == 0 || GEMM_THREADS % (BM * 8) == 0),
                  "whole m16 fragments; every thread copies as many A chunks, or the first BM * 8 threads one each");
    static_assert(STAGES >= 2 && (GROUPS == 1 || GROUPS == 2 || GROUPS == 4), "a pipeline; 4, 8 or 16-byte copies");
    static_assert(WROWS == GEMM_THREADS && GEMM_THREADS % B_ROW_CHUNKS == 0, "thread i copies row i's pairs");
    static_assert(!TILED || (BITS == 4 && GROUPS <= 2 && TILED_PIECE == 2 * KT), "a stage is at most one piece");
    // Words (pairs) from a weight row's k step kt (of KT inputs) to the next's: of one group, or a piece's.
    __device__ static int step_words(int kt) {
        return TILED ? (kt / 2) * TILED_PIECE_STEP + (kt % 2) * (KT / 8) : kt * (KT * BITS / 32);
    }
    __device__ static int step_pairs(int kt) { return TILED ? (kt / 2) * TILED_PAIR_STEP + kt % 2 : kt; }
};

// One weight row's source: its first packed word and scale/bias pair; `bytes` 16 to copy, 0 to zero-fill (a
// row past the matrix, whose pointers then stay at row 0).
struct WeightRow {
    const u32* packed;
    const u32* scale_bias;
    u32 bytes;
};

__device__ __forceinline__ WeightRow weight_row(Q4 w, int row, bool valid, int k, int bits) {
    const size_t r = valid ? (size_t)row : 0;
    return WeightRow{w.packed + r * (k * bits / 32), w.scale_bias + r * (k / KT), valid ? 16u : 0u};
}
// The same for a tiled matrix (4-bit): the row's words of its first piece.
__device__ __forceinline__ WeightRow tiled_weight_row(Q4 w, int row, bool valid, int k) {
    const int r = valid ? row : 0;
    return WeightRow{tiled_row(w, r, k), tiled_row_pairs(w, r, k), valid ? 16u : 0u};
}

__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ u32 dynamic_smem_bytes() {
    u32 v;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(v));
    return v;
}

__device__ __forceinline__ void cp_async_4(u32 dst, const void* src, u32 bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}
// Copies `bytes` (SIZE or 0) of the SIZE (4, 8 or 16) at `src`, zero-filling the rest.
template <int SIZE>
__device__ __forceinline__ void cp_async_ca(u32 dst, const void* src, u32 bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;" ::"r"(dst), "l"(src), "n"(SIZE), "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ u32 fma_bf16x2(u32 a, u32 b, u32 c) {
    u32 d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

#define BF16X2_ONE 0x3F803F80u
#define BF16X2_MINUS_128 0xC300C300u

// (a & mask) | bits as one LOP3. Written in C, ptxas emits an AND and an OR (a LOP3 takes one immediate), which
// made the dequantization below three integer instructions a pair of weights instead of two.
__device__ __forceinline__ u32 and_or(u32 a, u32 mask, u32 bits) {
    u32 d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(mask), "r"(bits));
    return d;
}

// The weights at k = 2t, 2t+1 of the 8 in `word` (4-bit codes), as bf16x2: scale * q + bias rounded once.
// `sel` = t | (t + 4) << 8 picks byte t of the word for the low half and of the word >> 4 for the high half.
__device__ __forceinline__ u32 dequant_q4(u32 word, u32 sel, u32 scale2, u32 bias2) {
    const u32 x = and_or(__byte_perm(word, word >> 4, sel), 0x000F000Fu, 0x43004300u);  // 128 + q, exact
    return fma_bf16x2(fma_bf16x2(x, BF16X2_ONE, BF16X2_MINUS_128), scale2, bias2);
}

// An 8-bit code as a float: the byte `sel` picks under the exponent of 2^23, minus 2^23.
__device__ __forceinline__ float code_q8(u32 word, u32 sel) {
    return __uint_as_float(__byte_perm(word, 0x4B000000u, sel)) - 8388608.f;
}

// The block's main loop: acc[mf][nf] += A rows 16 mf.. times the warp's weight rows 32 warp + 8 nf.., over
// k_tiles stages (of GROUPS k steps each) that `load` fills. FULL: every m16 fragment holds valid rows.
template <class T, bool FULL, class Load>
__device__ __forceinline__ void k_loop(float (&acc)[T::MF][4][4], const unsigned char* smem, int k_tiles,
                                       int mf_active, Load load) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int g = lane / 4, t = lane % 4;
    const u32 smem0 = smem_addr(smem);
    // ldmatrix.x4 of the m16 x k16 A fragment of step s: lanes 0-15 address rows 0-15 at chunk 2s, lanes
    // 16-31 the same rows at chunk 2s + 1; XOR with s << 5 turns chunk c ^ row into (c + 2s) ^ row.
    const u32 a_lane = (lane % 16) * 128 + (((lane / 16) ^ (lane % 8)) << 4);
    const int b_swizzle = g / (8 / T::B_CHUNKS);
    const u32 sel_q4 = t | ((t + 4) << 8);
    // 8-bit: the pair k = 2t, 2t+1 is bytes 2(t & 1), +1 of word t >> 1 of the 8 inputs' two words; each
    // selector puts one byte under 0x4B (the other bytes zero).
    const u32 sel_q8 = 2 * (t & 1) + 0x7440u;

#pragma unroll 1
    for (int kt = 0; kt < k_tiles; kt++) {
        cp_async_wait<T::STAGES - 2>();
        __syncthreads();  // stage kt has landed for every thread; stage kt - 1's buffer is free again
        if (kt + T::STAGES - 1 < k_tiles) load(kt + T::STAGES - 1);
        cp_async_commit();

        const int stage = kt % T::STAGES;
        const u32* sb_stage = (const u32*)(smem + stage * T::STAGE + T::A_BYTES + T::B_BYTES);
#pragma unroll
        for (int gi = 0; gi < T::GROUPS; gi++) {
            const u32 a_stage = smem0 + stage * T::STAGE + gi * T::A_SUB;
            const unsigned char* b_stage = smem + stage * T::STAGE + T::A_BYTES + gi * T::B_SUB;
            u32 sb[4];
#pragma unroll
            for (int nf = 0; nf < 4; nf++) sb[nf] = sb_stage[(warp * 32 + nf * 8 + g) * T::GROUPS + gi];

#pragma unroll
            for (int c = 0; c < T::B_CHUNKS; c++) {
                uint4 wv[4];
#pragma unroll
                for (int nf = 0; nf < 4; nf++)
                    wv[nf] = *(const uint4*)(b_stage + (warp * 32 + nf * 8 + g) * 16 * T::B_CHUNKS +
                                             ((c ^ b_swizzle) << 4));
#pragma unroll
                for (int ss = 0; ss < T::STEPS_PER_CHUNK; ss++) {
                    const int s = c * T::STEPS_PER_CHUNK + ss;
                    // b[nf][0..1]: the fragment (k 2t, 2t+1 | k 2t+8, 2t+9); 8-bit adds the lo parts b[nf][2..3].
                    u32 b[4][T::BITS == 8 ? 4 : 2];
#pragma unroll
                    for (int nf = 0; nf < 4; nf++) {
                        if constexpr (T::BITS == 4) {
                            const u32 scale2 = __byte_perm(sb[nf], sb[nf], 0x1010);
                            const u32 bias2 = __byte_perm(sb[nf], sb[nf], 0x3232);
#pragma unroll
                            for (int h = 0; h < 2; h++)
                                b[nf][h] = dequant_q4(word_of(wv[nf], 2 * ss + h), sel_q4, scale2, bias2);
                        } else {
                            const float2 f = pair_to_float2(sb[nf]);
#pragma unroll
                            for (int h = 0; h < 2; h++) {
                                const u32 word = (t & 2) ? word_of(wv[nf], 2 * h + 1) : word_of(wv[nf], 2 * h);
                                const float w0 = fmaf(code_q8(word, sel_q8), f.x, f.y);
                                const float w1 = fmaf(code_q8(word, sel_q8 + 1), f.x, f.y);
                                const u32 hi = pack_bf16x2(w0, w1);
                                b[nf][h] = hi;
                                b[nf][2 + h] = pack_bf16x2(w0 - __uint_as_float(hi << 16), w1 - __uint_as_float(hi & 0xffff0000u));
                            }
                        }
                    }
#pragma unroll
                    for (int mf = 0; mf < T::MF; mf++) {
                        if (FULL || mf < mf_active) {
                            u32 a[4];
                            ldmatrix_x4(a, a_stage + (a_lane ^ (s << 5)) + mf * 16 * 128);
#pragma unroll
                            for (int nf = 0; nf < 4; nf++) {
                                mma_bf16(acc[mf][nf], a, b[nf][0], b[nf][1]);
                                if constexpr (T::BITS == 8) mma_bf16(acc[mf][nf], a, b[nf][2], b[nf][3]);
                            }
                        }
                    }
                }
            }
        }
    }
}

// One block tile: `rows` valid activation rows (>= 1) whose starts a_row(r) gives, k inputs, weight rows
// from w_row(matrix, column in the tile); store(r, column in the tile, values at columns c and c + 1) is
// called for every valid row and every even column of the tile (NMAT = 2: the gate pair, then the up pair).
// WEIGHTS_FIRST: the weight rows do not depend on the previous kernel (a dense product), so the first stages'
// weights are requested before waiting for it (wait_previous); otherwise the caller has waited already (the
// grouped products, whose weight rows follow the routing).
template <class T, bool WEIGHTS_FIRST, class ARow, class WRow, class Store>
__device__ __forceinline__ void run_tile(int rows, int k, ARow a_row, WRow w_row, Store store) {
    extern __shared__ __align__(128) unsigned char smem[];
    if (dynamic_smem_bytes() < T::SMEM) __trap();  // the host's shared_bytes() disagrees with Tile::SMEM
    const int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP;
    const u32 smem0 = smem_addr(smem);

    // Copies: chunk tid % 8 of A rows tid / 8 + 32 i (below BM); all of weight row tid (so warp w copies its own
    // rows).
    const int a_chunk = tid % 8, a_first = tid / 8;
    const bf16* a_src[T::A_COPIES];
    u32 a_bytes[T::A_COPIES];
#pragma unroll
    for (int i = 0; i < T::A_COPIES; i++) {
        const int r = a_first + i * (GEMM_THREADS / 8);
        a_src[i] = (r < rows ? a_row(r) : a_row(0)) + a_chunk * 8;
        a_bytes[i] = r < rows ? 16 : 0;
    }
    const u32 a_dst = a_first * 128 + ((a_chunk ^ (a_first % 8)) << 4);
    // The weight row numbered 32 w + i in shared memory is warp w's row i: column w WCOLS + i % WCOLS of matrix
    // i / WCOLS of the tile.
    auto row_of = [&](int row) { return w_row((row % 32) / T::WCOLS, (row / 32) * T::WCOLS + (row % 32) % T::WCOLS); };
    const WeightRow wr = row_of(tid);
    const u32 b_dst = T::A_BYTES + tid * 16 * T::B_CHUNKS;
    const int b_swizzle = (tid / (8 / T::B_CHUNKS)) % T::B_CHUNKS;
    const u32 sb_dst = T::A_BYTES + T::B_BYTES + tid * 4 * T::GROUPS;
    // GROUPS > 1: a row's B_ROW_CHUNKS chunks of a stage lie together in memory, and consecutive threads copy
    // consecutive chunks of a row (a warp copies 32 / B_ROW_CHUNKS whole row segments), chunk q of row r going
    // to sub-stage q / B_CHUNKS, row r, chunk q % B_CHUNKS swizzled as above. A thread's B_COPIES rows are ROW_STEP
    // apart in one matrix, so it keeps the first row's source, two pitches (to the next row, and to the row after
    // it: in a tiled matrix, rows 2 ROW_STEP apart may lie in different blocks) and which rows are valid (every
    // row past the first invalid one is invalid too), not a pointer per row.
    constexpr int ROW_STEP = GEMM_THREADS / T::B_ROW_CHUNKS;
    static_assert(T::GROUPS == 1 || (ROW_STEP / (8 / T::B_CHUNKS)) % T::B_CHUNKS == 0, "one swizzle for a thread's rows");
    const int b_q = tid % T::B_ROW_CHUNKS, b_row = tid / T::B_ROW_CHUNKS;
    const u32* b_src = nullptr;
    int b_pitch = 0, b_pitch2 = 0;
    u32 b_valid = 0, b_to = 0;
    if constexpr (T::GROUPS > 1) {
        const WeightRow first = row_of(b_row);
        b_src = first.packed + 4 * b_q;
        // (Pitches of rows past the first invalid one are never used: those rows copy nothing.)
        if constexpr (T::B_COPIES > 1) b_pitch = (int)(row_of(b_row + ROW_STEP).packed - first.packed);
        if constexpr (T::B_COPIES > 2) b_pitch2 = (int)(row_of(b_row + 2 * ROW_STEP).packed - first.packed);
#pragma unroll
        for (int j = 0; j < T::B_COPIES; j++)
            if (row_of(b_row + j * ROW_STEP).bytes) b_valid |= 1u << j;
        const int sub = b_q / T::B_CHUNKS, c = b_q % T::B_CHUNKS;
        const int swizzle = (b_row / (8 / T::B_CHUNKS)) % T::B_CHUNKS;
        b_to = T::A_BYTES + sub * T::B_SUB + b_row * 16 * T::B_CHUNKS + ((c ^ swizzle) << 4);
    }
    auto load_a = [&](int kt) {
        const u32 stage = smem0 + (kt % T::STAGES) * T::STAGE;
#pragma unroll
        for (int gi = 0; gi < T::GROUPS; gi++)
#pragma unroll
            for (int i = 0; i < T::A_COPIES; i++)
                if (T::BM * 8 >= GEMM_THREADS || a_first < T::BM)
                    cp_async_16(stage + gi * T::A_SUB + a_dst + i * (GEMM_THREADS / 8) * 128,
                                a_src[i] + (kt * T::GROUPS + gi) * KT, a_bytes[i]);
    };
    auto load_b = [&](int kt) {
        const u32 stage = smem0 + (kt % T::STAGES) * T::STAGE;
        if constexpr (T::GROUPS == 1) {
#pragma unroll
            for (int c = 0; c < T::B_CHUNKS; c++)
                cp_async_16(stage + b_dst + ((c ^ b_swizzle) << 4), wr.packed + T::step_words(kt) + 4 * c, wr.bytes);
            cp_async_4(stage + sb_dst, wr.scale_bias + T::step_pairs(kt), wr.bytes / 4);
        } else {
#pragma unroll
            for (int j = 0; j < T::B_COPIES; j++) {
                const bool valid = (b_valid >> j) & 1;
                const int row_words = (j & 1) * b_pitch + (j >> 1) * b_pitch2;
                cp_async_16(stage + b_to + j * ROW_STEP * 16 * T::B_CHUNKS,
                            b_src + (valid ? row_words : 0) + T::step_words(kt * T::GROUPS), valid ? 16 : 0);
            }
            cp_async_ca<4 * T::GROUPS>(stage + sb_dst, wr.scale_bias + T::step_pairs(kt * T::GROUPS),
                                       wr.bytes / 16 * 4 * T::GROUPS);
        }
    };

    auto load = [&](int kt) {
        load_a(kt);
        load_b(kt);
    };

    // The prologue's stages, each a cp.async group; with WEIGHTS_FIRST the first group also holds every prologue
    // stage's weights, requested before the wait (the k loop's first wait covers all of them).
    const int k_tiles = k / (KT * T::GROUPS);
    if constexpr (WEIGHTS_FIRST) {
#pragma unroll
        for (int s = 0; s < T::STAGES - 1; s++)
            if (s < k_tiles) load_b(s);
        wait_previous();
    }
#pragma unroll
    for (int s = 0; s < T::STAGES - 1; s++) {
        if (s < k_tiles) {
            if constexpr (WEIGHTS_FIRST) load_a(s);
            else load(s);
        }
        cp_async_commit();
    }
    float acc[T::MF][4][4];
#pragma unroll
    for (int mf = 0; mf < T::MF; mf++)
#pragma unroll
        for (int nf = 0; nf < 4; nf++)
#pragma unroll
            for (int i = 0; i < 4; i++) acc[mf][nf][i] = 0.f;
    const int mf_active = (rows + 15) / 16;
    if (mf_active >= T::MF) k_loop<T, true>(acc, smem, k_tiles, mf_active, load);
    else k_loop<T, false>(acc, smem, k_tiles, mf_active, load);

    // D fragment: lane (g, t) holds rows g and g + 8 at columns 2t, 2t + 1.
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int mf = 0; mf < T::MF; mf++)
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const int r = mf * 16 + half * 8 + g;
            if (r >= rows) continue;
            if constexpr (T::NMAT == 1) {
#pragma unroll
                for (int nf = 0; nf < 4; nf++)
                    store(r, warp * 32 + nf * 8 + 2 * t, acc[mf][nf][2 * half], acc[mf][nf][2 * half + 1]);
            } else {
#pragma unroll
                for (int nf = 0; nf < 2; nf++)
                    store(r, warp * 16 + nf * 8 + 2 * t, acc[mf][nf][2 * half], acc[mf][nf][2 * half + 1],
                          acc[mf][nf + 2][2 * half], acc[mf][nf + 2][2 * half + 1]);
            }
        }
}

// out[m][n] = a[m][k] w[n][k]^T, or out += that.
template <class T>
__device__ __forceinline__ void dense_tile(const bf16* a, int m, Q4 w, int n, int k, float* out, int accumulate) {
    const int m0 = blockIdx.y * T::BM, n0 = blockIdx.x * T::BN;
    run_tile<T, true>(
        min(T::BM, m - m0), k, [&](int r) { return a + (size_t)(m0 + r) * k; },
        [&](int, int c) { return weight_row(w, n0 + c, n0 + c < n, k, T::BITS); },
        [&](int r, int c, float v0, float v1) {
            const int col = n0 + c;
            float* o = out + (size_t)(m0 + r) * n + col;
            if (n % 2 == 0) {  // col even: the pair is whole and 8-byte aligned
                if (col >= n) return;
                float2 v = make_float2(v0, v1);
                if (accumulate) {
                    const float2 prev = *(const float2*)o;
                    v.x += prev.x, v.y += prev.y;
                }
                *(float2*)o = v;
            } else {
                if (col < n) o[0] = accumulate ? o[0] + v0 : v0;
                if (col + 1 < n) o[1] = accumulate ? o[1] + v1 : v1;
            }
        });
}

template <int BITS>
__device__ __forceinline__ void dense(const bf16* a, int m, Q4 w, int n, int k, float* out, int accumulate) {
    if ((int)gridDim.y * 64 >= m) dense_tile<Tile<64, 1, BITS>>(a, m, w, n, k, out, accumulate);
    else dense_tile<Tile<128, 1, BITS>>(a, m, w, n, k, out, accumulate);
}

extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1)
    gemm_q4(const bf16* a, int m, Q4 w, int n, int k, float* out, int accumulate) {
    dense<4>(a, m, w, n, k, out, accumulate);
}

extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1)
    gemm_q8(const bf16* a, int m, Q4 w, int n, int k, float* out, int accumulate) {
    dense<8>(a, m, w, n, k, out, accumulate);
}

// gemm_q4 in 64-row tiles only, two blocks an SM: the 64-row tile needs 128 registers (the 128-row one that gemm_q4
// also holds needs 249), so a second block's warps hide the first's loads and dequantization. The host launches it
// for every 64-row tiling of a 4-bit product (a batched step's lm_head: 970 blocks) where `gemm_rows64_two` is 1.
#ifndef GEMM_ROWS64_TWO
#define GEMM_ROWS64_TWO 1
#endif
__device__ int gemm_rows64_two = GEMM_ROWS64_TWO;

extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 2)
    gemm_q4_rows64(const bf16* a, int m, Q4 w, int n, int k, float* out, int accumulate) {
    dense_tile<Tile<64, 1, 4>>(a, m, w, n, k, out, accumulate);
}

// ---- Dense 4-bit products on the warpgroup tensor cores (Hopper, sm_90a) ----
// The same product as gemm_q4 with 128-row tiles, for the GPUs that have wgmma: mma.sync reaches about a third of
// Hopper's tensor throughput, the asynchronous warpgroup MMA most of it. A block (two warpgroups, 256 threads)
// computes 128 activation rows by 256 weight rows, warpgroup w the rows 64 w .. 64 w + 63, with
// wgmma.m64n256k16 (128 f32 accumulators a thread). Both operands come from shared memory in the 128-byte
// swizzled K-major layout (a row of 64 bf16 is 128 bytes; 16-byte chunk c of row r lies at chunk c ^ (r % 8);
// eight rows make a 1,024-byte atom), which is the layout the activation tiles already have.
//
// Per k step of one quantization group: cp.async brings the activation tile and the packed weight rows (32 bytes
// and one (scale, bias) pair a row; thread i copies weight row i) GEMM_WGMMA_STAGES - 2 steps ahead; thread i
// turns its own row's 64 codes into bf16 (scale * q + bias, as gemm_q4 does) in one of three B buffers; a fence
// hands the shared memory writes to the asynchronous proxy and a barrier makes them everyone's; then each
// warpgroup issues its four k16 MMAs and, before the next step, waits until at most this step's are in flight.
// So step kt's dequantization overlaps step kt - 1's MMAs. The buffers are safe to refill: a stage is reloaded two
// steps after its MMAs were issued and a B buffer three, and every thread has passed a barrier since both
// warpgroups waited for those MMAs. Tiles of 192 or 128 weight rows (more blocks for products with few) spread
// each step's dequantization over all the threads instead (see wgmma_tile).
#ifndef GEMM_WGMMA
#define GEMM_WGMMA 1
#endif
#ifndef GEMM_WGMMA_STAGES
#define GEMM_WGMMA_STAGES 5
#endif
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) && GEMM_WGMMA
#define WGMMA_BUILT 1
#else
#define WGMMA_BUILT 0
#endif
constexpr int WG_ROWS = 128;
constexpr int WG_A = WG_ROWS * KT * 2;            // activation tile, bf16, swizzled
constexpr int WG_CODES = WROWS * KT / 2;          // packed 4-bit weights, 32 bytes a row
constexpr int WG_STAGE = WG_A + WG_CODES + WROWS * 4;
constexpr int WG_B = WROWS * KT * 2;              // dequantized weights, bf16, swizzled
constexpr int WG_B_BUFFERS = 3;
// (1,024 bytes more than the tiles: the kernel rounds its start up to an atom's alignment.)
constexpr int WG_SMEM = GEMM_WGMMA_STAGES * WG_STAGE + WG_B_BUFFERS * WG_B + 1024;
static_assert(WG_STAGE % 1024 == 0 && WG_A % 1024 == 0 && GEMM_WGMMA_STAGES >= 3,
              "every operand tile starts on a 1,024-byte swizzle atom; a stage is refilled two steps after use");
// With the tensor memory accelerator (dense products, see gemm_q4_wgmma_tma): a stage is the activation tile and the
// packed weights; the (scale, bias) pairs come four groups at a time (a copy's rows must be 16 bytes or more) into
// two slots of their own, then the B buffers, then a transaction barrier a stage.
constexpr int WG_TMA_STAGE = WG_A + WG_CODES;
constexpr int WG_TMA_PAIRS = WROWS * 16;  // four groups' pairs of 256 rows
constexpr int WG_TMA_SMEM =
    GEMM_WGMMA_STAGES * WG_TMA_STAGE + 2 * WG_TMA_PAIRS + WG_B_BUFFERS * WG_B + GEMM_WGMMA_STAGES * 8 + 1024;
static_assert(WG_TMA_STAGE % 1024 == 0 && GEMM_WGMMA_STAGES - 2 <= 4,
              "a stage starts on a swizzle atom; a pair slot is refilled only after the four steps that read it");
// Read by the host (src/gemm.rs): whether this build has the kernel (sm_90a), and its shared memory.
__device__ int gemm_wgmma = WGMMA_BUILT;
__device__ int gemm_wgmma_smem = WG_SMEM;
__device__ int gemm_wgmma_tma_smem = WG_TMA_SMEM;
// Whether the host gives the dense 128-row products to gemm_q4_wgmma_tma (1) or to gemm_q4_wgmma (0).
#ifndef GEMM_WGMMA_TMA
#define GEMM_WGMMA_TMA 1
#endif
__device__ int gemm_wgmma_tma = GEMM_WGMMA_TMA;
// The host's estimate of a 128-row tile's time here against gemm_q4's, in percent, where it weighs 128-row tiles
// against more 64-row ones (4,096-token prefill on the H200: 31.3 ms against 41.6 for the dense products).
#ifndef GEMM_WGMMA_COST
#define GEMM_WGMMA_COST 75
#endif
__device__ int gemm_wgmma_cost = GEMM_WGMMA_COST;
// Whether the host takes gemm_q4_wgmma_split for the split products of more than 64 rows (1) or gemm_q4_split (0):
// on, a batched step's output projections of 128 and 256 rows run on wgmma with k in parts (on the H200 about 1%
// and 0.4% of the step faster than the integer small tiling); the selftest checks both paths on Hopper.
#ifndef GEMM_WGMMA_SPLIT
#define GEMM_WGMMA_SPLIT 1
#endif
__device__ int gemm_wgmma_split = GEMM_WGMMA_SPLIT;

#if WGMMA_BUILT
// d += A (64 x 16) B (16 x N)^T, asynchronously, for N = 256, 192 or 128 (N / 2 f32 accumulators a thread);
// scale_d 0 ignores d.
#define WG_D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
                 "+f"(d[i + 6]), "+f"(d[i + 7])
template <int N>
__device__ __forceinline__ void wgmma_m64k16(float (&d)[N / 2], u64 desc_a, u64 desc_b, int scale_d) {
    static_assert(N == 256 || N == 192 || N == 128, "a tile width the kernels instantiate");
    if constexpr (N == 256) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
            "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
            "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
            "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
            "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,"
            "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,"
            "%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,"
            "%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,"
            "%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127"
            "}, %128, %129, p, 1, 1, 0, 0;\n}\n"
            : WG_D8(0), WG_D8(8), WG_D8(16), WG_D8(24), WG_D8(32), WG_D8(40), WG_D8(48), WG_D8(56), WG_D8(64),
              WG_D8(72), WG_D8(80), WG_D8(88), WG_D8(96), WG_D8(104), WG_D8(112), WG_D8(120)
            : "l"(desc_a), "l"(desc_b), "r"(scale_d));
    } else if constexpr (N == 192) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 {"
            "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
            "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
            "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
            "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,"
            "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,"
            "%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95"
            "}, %96, %97, p, 1, 1, 0, 0;\n}\n"
            : WG_D8(0), WG_D8(8), WG_D8(16), WG_D8(24), WG_D8(32), WG_D8(40), WG_D8(48), WG_D8(56), WG_D8(64),
              WG_D8(72), WG_D8(80), WG_D8(88)
            : "l"(desc_a), "l"(desc_b), "r"(scale_d));
    } else {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
            "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
            "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
            "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
            "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
            "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
            : WG_D8(0), WG_D8(8), WG_D8(16), WG_D8(24), WG_D8(32), WG_D8(40), WG_D8(48), WG_D8(56)
            : "l"(desc_a), "l"(desc_b), "r"(scale_d));
    }
}
// d += A (64 x 16, from registers: this thread's mma.m16n8k16 A fragment of its warp's 16 rows) B (N x 16)^T,
// asynchronously, for N = 256, 128, 64, 32 or 16 (N / 2 f32 accumulators a thread); a's registers must keep their
// values until the MMA has completed.
template <int N>
__device__ __forceinline__ void wgmma_m64k16_rs(float (&d)[N / 2], const u32 (&a)[4], u64 desc_b) {
    static_assert(N == 256 || N == 128 || N == 64 || N == 32 || N == 16, "a width the kernels instantiate");
    if constexpr (N == 256) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.eq.u32 p, 1, 1;\n"
            "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
            "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
            "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
            "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
            "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,"
            "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,"
            "%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,"
            "%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,"
            "%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127"
            "}, {%128, %129, %130, %131}, %132, p, 1, 1, 0;\n}\n"
            : WG_D8(0), WG_D8(8), WG_D8(16), WG_D8(24), WG_D8(32), WG_D8(40), WG_D8(48), WG_D8(56), WG_D8(64),
              WG_D8(72), WG_D8(80), WG_D8(88), WG_D8(96), WG_D8(104), WG_D8(112), WG_D8(120)
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
    } else if constexpr (N == 128) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.eq.u32 p, 1, 1;\n"
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
            "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
            "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
            "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
            "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
            "}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
            : WG_D8(0), WG_D8(8), WG_D8(16), WG_D8(24), WG_D8(32), WG_D8(40), WG_D8(48), WG_D8(56)
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
    } else if constexpr (N == 64) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.eq.u32 p, 1, 1;\n"
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
            "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
            "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"
            "}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
            : WG_D8(0), WG_D8(8), WG_D8(16), WG_D8(24)
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
    } else if constexpr (N == 32) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.eq.u32 p, 1, 1;\n"
            "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {"
            "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15"
            "}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
            : WG_D8(0), WG_D8(8)
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
    } else {
        asm volatile(
            "{\n.reg .pred p;\nsetp.eq.u32 p, 1, 1;\n"
            "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {"
            "%0,%1,%2,%3,%4,%5,%6,%7"
            "}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n"
            : WG_D8(0)
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
    }
}
#undef WG_D8

#endif

#if WGMMA_BUILT
// One block tile: 128 activation rows (`rows` of them valid, row r starting at a_row(r)) times 256 weight rows
// (row i from w_row(i); TILED: a tiled matrix's, whose steps lie piece by piece) over the k steps [step0, step0 +
// steps). Then store(r, c, v0, v1) for every valid row r and even column c of the tile (NMAT = 2: store(r, c, gate
// pair, up pair), where w_row gave 128 rows of gate, then the same 128 of up). WEIGHTS_FIRST: the weights do not
// depend on the previous kernel, so the prologue's are requested before waiting for it; otherwise the caller waited.
// SKIP_EMPTY: a warpgroup whose 64 rows all lie past `rows` issues no MMAs. The branch around the MMAs makes ptxas
// serialize every wgmma of the kernel (its C7520 note), so the dense products, whose tiles are full but for the
// last, do not take it.
// BN: the weight rows of the tile (256, or 192 or 128 for NMAT = 1: narrower tiles make more blocks where a product
// has too few to fill the SMs); thread i < BN copies and dequantizes weight row i.
// TMA (dense products, `tma` given): thread 0 brings each stage with three bulk tensor copies (the activation box,
// the packed weights' box, every fourth step the pairs' box) onto the stage's transaction barrier, which every
// thread waits on before reading the stage; a_row and w_row are not used.
struct WgmmaTma {
    const TmaMap* a;  // activations: bf16 [m][k], boxes of 64 x 128 rows, 128-byte swizzle
    const TmaMap* w;  // packed codes: bytes [n][k / 2], boxes of 32 x BN rows
    const TmaMap* s;  // (scale, bias) pairs: u32 [n][k / 64], boxes of 4 x BN rows
    int m0, n0;       // the tile's first activation row and weight row
};
template <int NMAT, bool TILED, bool WEIGHTS_FIRST, bool SKIP_EMPTY, int BN = WROWS, bool TMA = false, class ARow,
          class WRow, class Store>
__device__ __forceinline__ void wgmma_tile(int rows, int step0, int steps, ARow a_row, WRow w_row, Store store,
                                           WgmmaTma tma = {}) {
    static_assert(BN == WROWS || NMAT == 1, "gate/up tiles are 128 rows of each matrix");
    static_assert(!TMA || (NMAT == 1 && !TILED), "the bulk tensor copies take the dense products' row-major matrices");
    extern __shared__ __align__(128) unsigned char smem_raw[];
    if (dynamic_smem_bytes() < (TMA ? WG_TMA_SMEM : WG_SMEM)) __trap();  // the host's shared memory is not the kernel's
    const u32 raw0 = smem_addr(smem_raw), smem0 = (raw0 + 1023) & ~1023u;
    unsigned char* smem = smem_raw + (smem0 - raw0);
    const int tid = threadIdx.x;
    constexpr int STAGES = GEMM_WGMMA_STAGES;
    constexpr int STAGE_BYTES = TMA ? WG_TMA_STAGE : WG_STAGE;
    const u32 pairs0 = smem0 + STAGES * WG_TMA_STAGE;  // TMA: the two slots of four groups' pairs
    const u32 b0 = smem0 + STAGES * STAGE_BYTES + (TMA ? 2 * WG_TMA_PAIRS : 0);
    const u32 bars = b0 + WG_B_BUFFERS * WG_B;  // TMA: stage s's barrier at bars + 8 s
    // TMA: the (scale, bias) pair of weight row `row` at local step kt, in its slot of four groups.
    auto tma_pair = [&](int kt, int row) {
        return *(const u32*)(smem + (pairs0 - smem0) + ((kt / 4) % 2) * WG_TMA_PAIRS + row * 16 + (kt % 4) * 4);
    };
    // TMA: thread 0 announces local step kt's bytes on its stage's barrier and copies its weights (and, every fourth
    // step, the pairs of it and the next three); then, after its activations' producer, the activations.
    auto tma_expect_w = [&](int kt) {
        const u32 bar = bars + 8 * (kt % STAGES), stage = smem0 + (kt % STAGES) * WG_TMA_STAGE;
        mbarrier_arrive_expect(bar, WG_A + BN * 32 + (kt % 4 == 0 ? BN * 16 : 0));
        tma_load_2d(stage + WG_A, *tma.w, (step0 + kt) * (KT / 2), tma.n0, bar);
        if (kt % 4 == 0) tma_load_2d(pairs0 + ((kt / 4) % 2) * WG_TMA_PAIRS, *tma.s, step0 + kt, tma.n0, bar);
    };
    auto tma_a = [&](int kt) {
        tma_load_2d(smem0 + (kt % STAGES) * WG_TMA_STAGE, *tma.a, (step0 + kt) * KT, tma.m0, bars + 8 * (kt % STAGES));
    };

    // Copies: chunk tid % 8 of activation rows tid / 8 + 32 i (zero-filled past the tile's rows); weight row tid's
    // 32 bytes of codes and its pair (zero-filled past n, so those columns come out 0 and are not stored).
    const int a_chunk = tid % 8, a_first = tid / 8;
    const bf16* a_src[4];
    u32 a_bytes[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int r = a_first + 32 * i;
        a_src[i] = a_row(r < rows ? r : 0) + step0 * KT + a_chunk * 8;
        a_bytes[i] = r < rows ? 16u : 0u;
    }
    const u32 a_dst = a_first * 128 + ((a_chunk ^ (a_first % 8)) << 4);  // rows 32 apart share the swizzle
    const bool w_thread = BN == WROWS || tid < BN;  // warp-uniform: BN is a multiple of 64
    const WeightRow wr = w_row(w_thread ? tid : 0);
    // A step's words and pair of the row: of one group in a row-major matrix, of half a piece in a tiled one.
    auto step_words = [](int kt) { return TILED ? (kt / 2) * TILED_PIECE_STEP + (kt % 2) * (KT / 8) : kt * (KT / 8); };
    auto step_pairs = [](int kt) { return TILED ? (kt / 2) * TILED_PAIR_STEP + kt % 2 : kt; };
    auto load_w = [&](int kt) {
        if (!w_thread) return;
        const u32 stage = smem0 + (kt % STAGES) * WG_STAGE + WG_A;
        const u32* src = wr.packed + step_words(step0 + kt);
        cp_async_16(stage + tid * 32, src, wr.bytes);
        cp_async_16(stage + tid * 32 + 16, src + 4, wr.bytes);
        cp_async_4(stage + WG_CODES + tid * 4, wr.scale_bias + step_pairs(step0 + kt), wr.bytes / 4);
    };
    auto load_a = [&](int kt) {
        const u32 stage = smem0 + (kt % STAGES) * WG_STAGE;
#pragma unroll
        for (int i = 0; i < 4; i++) cp_async_16(stage + a_dst + i * 32 * 128, a_src[i] + kt * KT, a_bytes[i]);
    };

    // The prologue, a group a stage; with WEIGHTS_FIRST its weights before the wait for the activations' producer.
    const int k_tiles = steps;
    if constexpr (TMA) {
        static_assert(WEIGHTS_FIRST, "the dense products' weights do not depend on the previous kernel");
        if (step0 % 4 != 0) __trap();  // the pairs' boxes of four groups start at the tile's first step
        if (tid == 0) {
#pragma unroll
            for (int s = 0; s < STAGES; s++) mbarrier_init(bars + 8 * s, 1);
            mbarrier_init_fence();
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // and to the copies' proxy
#pragma unroll
            for (int s = 0; s < STAGES - 2; s++)
                if (s < k_tiles) tma_expect_w(s);
        }
        wait_previous();
        if (tid == 0) {
#pragma unroll
            for (int s = 0; s < STAGES - 2; s++)
                if (s < k_tiles) tma_a(s);
        }
        __syncthreads();  // the barriers are initialised
    } else if constexpr (WEIGHTS_FIRST) {
#pragma unroll
        for (int s = 0; s < STAGES - 2; s++)
            if (s < k_tiles) load_w(s);
        wait_previous();
    }
    if constexpr (!TMA) {
#pragma unroll
        for (int s = 0; s < STAGES - 2; s++) {
            if (s < k_tiles) {
                if constexpr (!WEIGHTS_FIRST) load_w(s);
                load_a(s);
            }
            cp_async_commit();
        }
    }

    float d[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; i++) d[i] = 0.f;
    const int wg = tid / 128;
    // Passed through a shuffle so ptxas knows the branch around the MMAs is warp-uniform (it does not serialize them).
    const bool wg_rows = !SKIP_EMPTY || __shfl_sync(0xffffffffu, wg * 64 < rows, 0);
    const u32 sel[4] = {0x0400u, 0x0501u, 0x0602u, 0x0703u};  // t | (t + 4) << 8: k = 2t, 2t + 1 of a word
    const u32 b_row = tid * 128, b_swizzle = tid % 8;
    // SPREAD (tiles narrower than the threads): every thread dequantizes code word tid % 8 (a 16-byte chunk of
    // bf16) of weight rows tid / 8 + 32 i, so the step's dequantization is spread over all eight warps, not left to
    // the first BN / 32. Rows copied by other threads are read only after a barrier: each step waits for its own
    // copies of the next stage before the step's barrier, one step earlier than a thread that reads only its own row.
    // With TMA every thread waits on the stage's barrier, which shows it every row.
    constexpr bool SPREAD = BN < WROWS;
    static_assert(!SPREAD || STAGES >= 4, "the copies run two steps ahead of the barrier that shows them");
    if constexpr (SPREAD && !TMA) {
        cp_async_wait<STAGES - 3>();  // stage 0, for every thread after the barrier
        __syncthreads();
    }
#pragma unroll 1
    for (int kt = 0; kt < k_tiles; kt++) {
        if constexpr (TMA) mbarrier_wait(bars + 8 * (kt % STAGES), (kt / STAGES) % 2);
        else if constexpr (!SPREAD) cp_async_wait<STAGES - 3>();  // this thread's copies of stage kt have landed
        const int stage = kt % STAGES;
        const u32 b_buf = b0 + (kt % WG_B_BUFFERS) * WG_B;
        if constexpr (SPREAD) {
            const unsigned char* st = smem + stage * STAGE_BYTES + WG_A;
            const int c = tid % 8, swizzle = (tid / 8) % 8;
#pragma unroll
            for (int i = 0; i < BN / 32; i++) {
                const int row = tid / 8 + 32 * i;
                const u32 word = *(const u32*)(st + row * 32 + c * 4);
                const u32 sb = TMA ? tma_pair(kt, row) : *(const u32*)(st + WG_CODES + row * 4);
                const u32 scale2 = __byte_perm(sb, sb, 0x1010), bias2 = __byte_perm(sb, sb, 0x3232);
                u32 v[4];
#pragma unroll
                for (int t = 0; t < 4; t++) v[t] = dequant_q4(word, sel[t], scale2, bias2);
                const u32 dst = b_buf + row * 128 + ((c ^ swizzle) << 4);
                asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(dst), "r"(v[0]), "r"(v[1]), "r"(v[2]),
                             "r"(v[3])
                             : "memory");
            }
            if constexpr (!TMA) cp_async_wait<STAGES - 4>();  // copies of stage kt + 1, for all after the barrier
        } else if (w_thread) {
            const unsigned char* codes = smem + stage * STAGE_BYTES + WG_A + tid * 32;
            const uint4 lo = *(const uint4*)codes, hi = *(const uint4*)(codes + 16);
            const u32 sb = TMA ? tma_pair(kt, tid) : *(const u32*)(smem + stage * WG_STAGE + WG_A + WG_CODES + tid * 4);
            const u32 scale2 = __byte_perm(sb, sb, 0x1010), bias2 = __byte_perm(sb, sb, 0x3232);
#pragma unroll
            for (int c = 0; c < 8; c++) {
                const u32 word = word_of(c < 4 ? lo : hi, c % 4);
                u32 v[4];
#pragma unroll
                for (int t = 0; t < 4; t++) v[t] = dequant_q4(word, sel[t], scale2, bias2);
                asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(b_buf + b_row +
                                                                              ((c ^ b_swizzle) << 4)),
                             "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3])
                             : "memory");
            }
        }
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // this thread's writes and copies, for wgmma
        __syncthreads();
        if constexpr (TMA) {
            if (tid == 0 && kt + STAGES - 2 < k_tiles) {
                tma_expect_w(kt + STAGES - 2);
                tma_a(kt + STAGES - 2);
            }
        } else {
            if (kt + STAGES - 2 < k_tiles) {
                load_w(kt + STAGES - 2);
                load_a(kt + STAGES - 2);
            }
            cp_async_commit();
        }
        const u32 a_tile = smem0 + stage * STAGE_BYTES + wg * 64 * 128;
        wgmma_fence();
        wgmma_hold(d);
        if (wg_rows) {
#pragma unroll
            for (int s = 0; s < KT / 16; s++)
                wgmma_m64k16<BN>(d, wgmma_desc(a_tile + 32 * s), wgmma_desc(b_buf + 32 * s), 1);
        }
        wgmma_commit();
        wgmma_wait<1>();
        wgmma_hold(d);
    }
    wgmma_wait<0>();
    wgmma_hold(d);

    // Accumulator layout: warp q of the warpgroup holds rows 16 q .. 16 q + 15; lane (g, t) of it rows g and g + 8
    // at columns 8 j + 2 t, + 1 of every n8 block j (registers 4 j .. 4 j + 3).
    const int lane = tid % WARP, g = lane / 4, t = lane % 4, q = (tid % 128) / WARP;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int r = wg * 64 + q * 16 + g + 8 * h;
        if (r >= rows) continue;
        if constexpr (NMAT == 1) {
#pragma unroll
            for (int j = 0; j < BN / 8; j++) store(r, 8 * j + 2 * t, d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
        } else {
#pragma unroll
            for (int j = 0; j < WROWS / 16; j++)
                store(r, 8 * j + 2 * t, d[4 * j + 2 * h], d[4 * j + 2 * h + 1], d[4 * (j + 16) + 2 * h],
                      d[4 * (j + 16) + 2 * h + 1]);
        }
    }
}
#endif

// The dense warpgroup products' epilogue: out[m0 + r][n0 + c, + 1] = (v0, v1), or += where `accumulate` is 1;
// columns past n are not stored.
struct DenseStore {
    float* out;
    int n, m0, n0, accumulate;
    __device__ __forceinline__ void operator()(int r, int c, float v0, float v1) const {
        const int col = n0 + c;
        float* o = out + (size_t)(m0 + r) * n;
        if (n % 2 == 0) {  // col even: the pair is whole and 8-byte aligned
            if (col >= n) return;
            float2 v = make_float2(v0, v1);
            if (accumulate) {
                const float2 prev = *(const float2*)(o + col);
                v.x += prev.x, v.y += prev.y;
            }
            *(float2*)(o + col) = v;
        } else {
            if (col < n) o[col] = accumulate ? o[col] + v0 : v0;
            if (col + 1 < n) o[col + 1] = accumulate ? o[col + 1] + v1 : v1;
        }
    }
};

// gemm_q4 in 128-row tiles: block (`cols` weight rows, 128 activation rows), cols 256, 192 or 128 (the host picks
// the width whose blocks cover the SMs in the fewest rounds).
#if WGMMA_BUILT
template <int BN>
__device__ __forceinline__ void dense_wgmma(const bf16* a, int m, Q4 w, int n, int k, float* out, int accumulate) {
    const int m0 = blockIdx.y * WG_ROWS, n0 = blockIdx.x * BN;
    wgmma_tile<1, false, true, false, BN>(
        min(WG_ROWS, m - m0), 0, k / KT, [&](int r) { return a + (size_t)(m0 + r) * k; },
        [&](int i) { return weight_row(w, n0 + i, n0 + i < n, k, 4); },
        DenseStore{out, n, m0, n0, accumulate});
}
#endif

extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1)
    gemm_q4_wgmma(const bf16* a, int m, Q4 w, int n, int k, float* out, int accumulate) {
#if WGMMA_BUILT
    dense_wgmma<WROWS>(a, m, w, n, k, out, accumulate);
#else
    wait_previous();
    __trap();  // built without wgmma: the host never launches it (gemm_wgmma is 0)
#endif
}

// The narrower tiles in a kernel of their own, so the 256-wide kernel's code is only its own.
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1)
    gemm_q4_wgmma_narrow(const bf16* a, int m, Q4 w, int n, int k, float* out, int accumulate, int cols) {
#if WGMMA_BUILT
    if (cols == 128) dense_wgmma<128>(a, m, w, n, k, out, accumulate);
    else if (cols == 192) dense_wgmma<192>(a, m, w, n, k, out, accumulate);
    else __trap();  // a width the host never gives
#else
    wait_previous();
    __trap();  // built without wgmma: the host never launches it (gemm_wgmma is 0)
#endif
}

// gemm_q4_wgmma with its operands brought by the tensor memory accelerator: the host encodes the activations, the
// packed weights and their pairs as tensor maps (src/gemm.rs). With cp.async every thread issued seven copies a
// step, three of them of 32 rows 1 KB apart in a warp (a tag lookup a row); the load queue's throttling then held the
// warps at the copies and at the registers the copies still read, most of the time the tensor cores waited.
// Here one thread issues three copies a step and the load pipe stays free for the dequantization's shared reads.
#if WGMMA_BUILT
template <int BN>
__device__ __forceinline__ void dense_wgmma_tma(const TmaMap& a_map, const TmaMap& w_map, const TmaMap& s_map, int m,
                                                int n, int k, float* out, int accumulate) {
    const int m0 = blockIdx.y * WG_ROWS, n0 = blockIdx.x * BN;
    const WgmmaTma tma = {&a_map, &w_map, &s_map, m0, n0};
    wgmma_tile<1, false, true, false, BN, true>(
        min(WG_ROWS, m - m0), 0, k / KT, [](int) { return (const bf16*)nullptr; },
        [](int) { return WeightRow{nullptr, nullptr, 0u}; },
        DenseStore{out, n, m0, n0, accumulate}, tma);
}
#endif

extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1)
    gemm_q4_wgmma_tma(const __grid_constant__ TmaMap a_map, const __grid_constant__ TmaMap w_map,
                      const __grid_constant__ TmaMap s_map, int m, int n, int k, float* out, int accumulate) {
#if WGMMA_BUILT
    dense_wgmma_tma<WROWS>(a_map, w_map, s_map, m, n, k, out, accumulate);
#else
    wait_previous();
    __trap();  // built without wgmma: the host never launches it (gemm_wgmma is 0)
#endif
}

extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1)
    gemm_q4_wgmma_tma_narrow(const __grid_constant__ TmaMap a_map, const __grid_constant__ TmaMap w_map,
                             const __grid_constant__ TmaMap s_map, int m, int n, int k, float* out, int accumulate,
                             int cols) {
#if WGMMA_BUILT
    if (cols == 128) dense_wgmma_tma<128>(a_map, w_map, s_map, m, n, k, out, accumulate);
    else if (cols == 192) dense_wgmma_tma<192>(a_map, w_map, s_map, m, n, k, out, accumulate);
    else __trap();  // a width the host never gives
#else
    wait_previous();
    __trap();  // built without wgmma: the host never launches it (gemm_wgmma is 0)
#endif
}

// ---- Dense 4-bit products with the weights in registers (gemm_q4_wgmma_rs, Hopper) ----
// Dequantized weights written to shared memory for wgmma to read cost 32 KB of bf16 a step for a 256-row tile, and
// the MMAs wait on the warps that write them. So the roles of the operands swap, as in mixed-input products on
// Hopper: the weights are wgmma's A operand, taken from registers, and the activations its B operand, from shared
// memory. A block computes the product's transpose for 128 weight rows by 256 activation rows; consumer warpgroup
// w takes weight rows 64 w .. 64 w + 63 against all 256 activation rows (m64n256k16).
// Each consumer thread dequantizes its own A fragment (rows g and g + 8 of its warp's 16, inputs 2t, 2t + 1 and
// 2t + 8, 2t + 9 of each k16 slice: byte t of a packed word, as in gemm_q4) from the stage's codes into registers,
// one step ahead of the MMAs that read them (two sets of registers, by step parity), so dequantization overlaps
// the asynchronous MMAs and no dequantized weight touches shared memory.
// A stage is the activation box (64 inputs by 256 rows, 128-byte swizzle: the K-major layout wgmma's B reads), the
// codes' box (32 bytes by 128 rows) and, every fourth step, the pairs' box (four groups by 128 rows) in a slot of
// its own. Thread 0 of the first warpgroup issues the copies onto the stage's transaction barrier (full); each
// consumer warp arrives on the stage's empty barrier once its MMAs that read the stage have completed, and thread 0
// waits for that before it refills the stage. The epilogue writes the transposed tile into shared memory as the
// output's boxes of 32 columns by 256 rows (128-byte swizzle) and stores them with bulk tensor copies (adding them
// where the product accumulates), which drop what lies past m or n.
#ifndef GEMM_WGMMA_RS
#define GEMM_WGMMA_RS 1
#endif
#ifndef GEMM_RS_STAGES
#define GEMM_RS_STAGES 5
#endif
constexpr int RS_ROWS = 256;                       // activation rows of a tile (wgmma's n)
constexpr int RS_COLS = 128;                       // weight rows of a tile (two warpgroups' m64)
constexpr int RS_X = RS_ROWS * KT * 2;             // the activation box
constexpr int RS_CODES = RS_COLS * KT / 2;         // the codes' box
constexpr int RS_STAGE = RS_X + RS_CODES;
constexpr int RS_PAIRS = RS_COLS * 16;             // four groups' pairs of 128 rows
constexpr int RS_PAIR_SLOTS = 2;
constexpr int RS_OUT_BOX = RS_ROWS * 128;          // an output box: 32 f32 columns by 256 rows
// A block is a producer warpgroup and two consumer warpgroups. The consumers' 128 accumulators and their two sets of
// A registers need more than the registers a thread has at launch (one block an SM), so setmaxnreg moves them from
// the producer, whose thread 0 only issues copies, to the consumers.
constexpr int RS_THREADS = 384;
constexpr int RS_LAUNCH_REGS = 65536 / RS_THREADS / 8 * 8;  // 168
constexpr int RS_PRODUCER_REGS = 40;
constexpr int RS_CONSUMER_REGS = (RS_THREADS * RS_LAUNCH_REGS - 128 * RS_PRODUCER_REGS) / 256 / 8 * 8;  // 232
static_assert(RS_CONSUMER_REGS >= RS_LAUNCH_REGS, "the consumers gain registers, the producer gives them up");
constexpr int RS_SMEM = GEMM_RS_STAGES * RS_STAGE + RS_PAIR_SLOTS * RS_PAIRS + 2 * GEMM_RS_STAGES * 8 + 1024;
static_assert(RS_STAGE % 1024 == 0 && RS_X % 1024 == 0, "every activation box starts on a swizzle atom");
// The pairs' slot of steps 4 j .. 4 j + 3 is refilled with step 4 (j + slots), once step 4 (j + slots) - stages is
// done; its last reader, step 4 j + 3, must be no later.
static_assert(GEMM_RS_STAGES >= 2 && 4 * RS_PAIR_SLOTS >= GEMM_RS_STAGES + 3,
              "a pairs' slot is refilled after its last reader");
static_assert(RS_SMEM <= 227 * 1024 && RS_COLS / 32 * RS_OUT_BOX <= GEMM_RS_STAGES * RS_STAGE,
              "a block's shared memory on Hopper; the output tile fits over the stages");
__device__ int gemm_wgmma_rs = GEMM_WGMMA_RS;
__device__ int gemm_wgmma_rs_smem = RS_SMEM;
__device__ int gemm_wgmma_rs_threads = RS_THREADS;

extern "C" __global__ void __launch_bounds__(RS_THREADS, 1)
    gemm_q4_wgmma_rs(const __grid_constant__ TmaMap a_map, const __grid_constant__ TmaMap w_map,
                     const __grid_constant__ TmaMap s_map, const __grid_constant__ TmaMap o_map, int m, int n,
                     int k, int accumulate) {
#if WGMMA_BUILT
    extern __shared__ __align__(128) unsigned char rs_raw[];
    if (dynamic_smem_bytes() < RS_SMEM || blockDim.x != RS_THREADS) __trap();  // the host's launch is not the kernel's
    constexpr int STAGES = GEMM_RS_STAGES;
    const u32 raw0 = smem_addr(rs_raw), smem0 = (raw0 + 1023) & ~1023u;
    unsigned char* smem = rs_raw + (smem0 - raw0);
    const u32 pairs0 = smem0 + STAGES * RS_STAGE;
    const u32 full = pairs0 + RS_PAIR_SLOTS * RS_PAIRS, empty = full + 8 * STAGES;
    const int tid = threadIdx.x, lane = tid % WARP;
    const int n0 = blockIdx.x * RS_COLS, m0 = blockIdx.y * RS_ROWS;
    const int k_tiles = k / KT;

    // Thread 0: step kt's copies onto its stage's barrier (the weights' first: they do not depend on the kernel
    // before).
    auto copy_w = [&](int kt) {
        const u32 bar = full + 8 * (kt % STAGES), stage = smem0 + (kt % STAGES) * RS_STAGE;
        mbarrier_arrive_expect(bar, RS_X + RS_CODES + (kt % 4 == 0 ? RS_PAIRS : 0));
        tma_load_2d(stage + RS_X, w_map, kt * (KT / 2), n0, bar);
        if (kt % 4 == 0) tma_load_2d(pairs0 + ((kt / 4) % RS_PAIR_SLOTS) * RS_PAIRS, s_map, kt, n0, bar);
    };
    auto copy_x = [&](int kt) {
        tma_load_2d(smem0 + (kt % STAGES) * RS_STAGE, a_map, kt * KT, m0, full + 8 * (kt % STAGES));
    };
    if (tid == 0) {
        for (int s = 0; s < STAGES; s++) {
            mbarrier_init(full + 8 * s, 1);
            mbarrier_init(empty + 8 * s, 8);
        }
        mbarrier_init_fence();
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // and to the copies' proxy
        for (int s = 0; s < STAGES && s < k_tiles; s++) copy_w(s);
    }
    wait_previous();
    if (tid == 0)
        for (int s = 0; s < STAGES && s < k_tiles; s++) copy_x(s);
    __syncthreads();  // the barriers are initialised

    if (tid < 128) {
        // The producer: thread 0 refills each stage once the consumers are done with it.
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(RS_PRODUCER_REGS) : "memory");
        if (tid == 0) {
#pragma unroll 1
            for (int kt = STAGES; kt < k_tiles; kt++) {
                mbarrier_wait(empty + 8 * (kt % STAGES), (kt / STAGES - 1) % 2);
                copy_w(kt);
                copy_x(kt);
            }
        }
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(RS_CONSUMER_REGS) : "memory");
    const int ct = tid - 128, wg = ct / 128, q = (ct % 128) / WARP, g = lane / 4, t = lane % 4;
    const int row0 = wg * 64 + q * 16 + g;  // this thread's weight rows: row0 and row0 + 8 of the tile
    const u32 sel = 0x0400u + 0x0101u * (u32)t;  // byte t of a word: inputs 2t, 2t + 1
    float d[128];
#pragma unroll
    for (int i = 0; i < 128; i++) d[i] = 0.f;
    // Step kt's A fragments of its four k16 slices, dequantized from the stage's codes (after its barrier).
    auto dequant = [&](int kt, u32 (&a)[4][4]) {
        mbarrier_wait(full + 8 * (kt % STAGES), (kt / STAGES) % 2);
        const unsigned char* codes = smem + (kt % STAGES) * RS_STAGE + RS_X;
        const unsigned char* pairs = smem + (pairs0 - smem0) + ((kt / 4) % RS_PAIR_SLOTS) * RS_PAIRS + (kt % 4) * 4;
        const uint4 lo0 = *(const uint4*)(codes + row0 * 32), hi0 = *(const uint4*)(codes + row0 * 32 + 16);
        const uint4 lo1 = *(const uint4*)(codes + (row0 + 8) * 32), hi1 = *(const uint4*)(codes + (row0 + 8) * 32 + 16);
        const u32 sb0 = *(const u32*)(pairs + row0 * 16), sb1 = *(const u32*)(pairs + (row0 + 8) * 16);
        const u32 scale0 = __byte_perm(sb0, sb0, 0x1010), bias0 = __byte_perm(sb0, sb0, 0x3232);
        const u32 scale1 = __byte_perm(sb1, sb1, 0x1010), bias1 = __byte_perm(sb1, sb1, 0x3232);
#pragma unroll
        for (int s = 0; s < KT / 16; s++) {
            const u32 w0a = word_of(s < 2 ? lo0 : hi0, (2 * s) % 4), w0b = word_of(s < 2 ? lo0 : hi0, (2 * s + 1) % 4);
            const u32 w1a = word_of(s < 2 ? lo1 : hi1, (2 * s) % 4), w1b = word_of(s < 2 ? lo1 : hi1, (2 * s + 1) % 4);
            a[s][0] = dequant_q4(w0a, sel, scale0, bias0);
            a[s][1] = dequant_q4(w1a, sel, scale1, bias1);
            a[s][2] = dequant_q4(w0b, sel, scale0, bias0);
            a[s][3] = dequant_q4(w1b, sel, scale1, bias1);
        }
    };
    // Step kt's MMAs from fragments a; then, once step kt - 1's have completed, its stage is released.
    auto mma = [&](int kt, const u32 (&a)[4][4]) {
        const u32 x_tile = smem0 + (kt % STAGES) * RS_STAGE;
        wgmma_fence();
        wgmma_hold(d);
#pragma unroll
        for (int s = 0; s < KT / 16; s++) wgmma_m64k16_rs<RS_ROWS>(d, a[s], wgmma_desc(x_tile + 32 * s));
        wgmma_commit();
        wgmma_wait<1>();
        wgmma_hold(d);
        if (kt > 0 && lane == 0) mbarrier_arrive(empty + 8 * ((kt - 1) % STAGES));
    };
    u32 a0[4][4], a1[4][4];
    dequant(0, a0);
#pragma unroll 1
    for (int kt = 0; kt < k_tiles; kt += 2) {
        mma(kt, a0);
        if (kt + 1 < k_tiles) {
            dequant(kt + 1, a1);
            mma(kt + 1, a1);
        }
        if (kt + 2 < k_tiles) dequant(kt + 2, a0);
    }
    wgmma_wait<0>();
    wgmma_hold(d);

    // The epilogue: d holds weight rows row0 (+ 8 h) at activation rows 8 j + 2 t (+ 1), registers 4 j + 2 h (+ 1).
    // Weight row c of the tile lies in output box c / 32, 16-byte chunk (c % 32) / 4 of each activation row's 128
    // bytes, swizzled by the activation row.
    asm volatile("bar.sync 1, 256;" ::: "memory");  // both consumers' MMAs are done with the stages
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int c = row0 + 8 * h;
        const u32 box = smem0 + (c / 32) * RS_OUT_BOX + (c % 4) * 4;
#pragma unroll
        for (int j = 0; j < RS_ROWS / 8; j++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int r = 8 * j + 2 * t + e;
                const u32 dst = box + r * 128 + ((((c % 32) / 4) ^ (r % 8)) << 4);
                asm volatile("st.shared.f32 [%0], %1;" ::"r"(dst), "f"(d[4 * j + 2 * h + e]) : "memory");
            }
        }
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // this thread's writes, for the bulk copies
    asm volatile("bar.sync 1, 256;" ::: "memory");
    if (ct == 0) {
#pragma unroll
        for (int box = 0; box < RS_COLS / 32; box++) {
            if (n0 + 32 * box >= n) break;
            if (accumulate) tma_store_2d<true>(o_map, n0 + 32 * box, m0, smem0 + box * RS_OUT_BOX);
            else tma_store_2d<false>(o_map, n0 + 32 * box, m0, smem0 + box * RS_OUT_BOX);
        }
        tma_store_wait();
    }
#else
    wait_previous();
    __trap();  // built without wgmma: the host never launches it (gemm_wgmma is 0)
#endif
}

__device__ __forceinline__ u32 swiglu_pair(float g0, float g1, float u0, float u1) {
    return (u32)float_to_bf16(siluf_(g0) * u0) | (u32)float_to_bf16(siluf_(g1) * u1) << 16;
}

// ---- Split products: few rows (a short prompt, a batched decode step) ----
// A product of few rows has few block tiles: out_proj (2048 rows) is 8 tiles of 256 weight rows, so most SMs would
// idle while each block walks the whole k range alone. The split products cut k into gridDim.z parts, one block
// per (tile, part), 64-row tiles and two blocks an SM; each block writes its partial tile (f32, the tile's valid
// rows by its 256 weight rows) to its slot of `gemm_partials`. A second launch, gemm_split_sum, then sums every
// output element's parts in the order of k (part 0 first, so the sum does not depend on which block finished
// when) with one thread per 4 columns, and applies the product's epilogue (accumulate). Launches on one stream
// run one after another (a dependent launch writes only after its wait), so they share the slots; the host keeps
// tiles x parts within `gemm_split_blocks`. A part of k is whole quantization groups (k steps), so each part loads
// and dequantizes as the unsplit kernel does; only the order of the f32 sum over k changes (by parts, then within
// each part).

#define SPLIT_ROWS SPLIT_TILE_ROWS
#define SPLIT_BLOCKS 1024
// The host's plan: blocks of a split product per SM it aims for, and the fewest k steps a part takes.
#ifndef SPLIT_BLOCKS_PER_SM
#define SPLIT_BLOCKS_PER_SM 2
#endif
#ifndef SPLIT_MIN_STEPS
#define SPLIT_MIN_STEPS 2
#endif
// The host splits a product while its 64-row tiles take fewer than SPLIT_TILE_ROUNDS rounds over the SMs (one
// tile an SM a round), into as many parts as fill SPLIT_ROUNDS rounds of SPLIT_BLOCKS_PER_SM blocks an SM.
#ifndef SPLIT_TILE_ROUNDS
#define SPLIT_TILE_ROUNDS 1
#endif
#ifndef SPLIT_ROUNDS
#define SPLIT_ROUNDS 1
#endif

__device__ int gemm_split_blocks = SPLIT_BLOCKS;
__device__ int gemm_split_blocks_per_sm = SPLIT_BLOCKS_PER_SM;
__device__ int gemm_split_min_steps = SPLIT_MIN_STEPS;
__device__ int gemm_split_tile_rounds = SPLIT_TILE_ROUNDS;
__device__ int gemm_split_rounds = SPLIT_ROUNDS;
__device__ int gemm_split_rows = SPLIT_ROWS;
__device__ __align__(16) float gemm_partials[(size_t)SPLIT_BLOCKS * SPLIT_ROWS * WROWS];
static_assert(WROWS == SPLIT_TILE_COLS, "the slots' tiles (common.cuh) are a block's weight rows wide");

// This block's part of k: k steps [first, end) of k_tiles, every part at least one step (the host splits k_tiles
// into at most k_tiles parts).
__device__ __forceinline__ int2 split_steps(int k_tiles) {
    const int z = blockIdx.z, parts = gridDim.z;
    return make_int2(z * k_tiles / parts, (z + 1) * k_tiles / parts);
}

// The partial tile of (tile, part) among `tiles` tiles: rows by WROWS columns, columns numbered as the weight rows
// of the tile.
__device__ __forceinline__ float* partial_slot(int tile, int part, int tiles) {
    return gemm_partials + (size_t)(part * tiles + tile) * SPLIT_ROWS * WROWS;
}

// The partial of this block's part of k: acc over its k steps, stored by (row, weight row of the tile).
template <class T, class ARow, class WRow>
__device__ __forceinline__ void split_partial(int rows, int k, ARow a_row, WRow w_row) {
    const int2 steps = split_steps(k / KT);
    const int tile = blockIdx.x + gridDim.x * blockIdx.y;
    float* slot = partial_slot(tile, blockIdx.z, gridDim.x * gridDim.y);
    auto a_part = [&](int r) { return a_row(r) + steps.x * KT; };
    auto w_part = [&](int mat, int c) {
        WeightRow wr = w_row(mat, c);
        wr.packed += (size_t)steps.x * 2 * T::BITS;
        wr.scale_bias += steps.x;
        return wr;
    };
    const int k_part = (steps.y - steps.x) * KT;
    run_tile<T, true>(rows, k_part, a_part, w_part, [&](int r, int c, float v0, float v1) {
        *(float2*)(slot + r * WROWS + c) = make_float2(v0, v1);
    });
}

template <int BITS>
__device__ __forceinline__ void dense_split(const bf16* a, int m, Q4 w, int n, int k) {
    typedef Tile<SPLIT_ROWS, 1, BITS> T;
    const int m0 = blockIdx.y * SPLIT_ROWS, n0 = blockIdx.x * T::BN;
    split_partial<T>(
        min(SPLIT_ROWS, m - m0), k, [&](int r) { return a + (size_t)(m0 + r) * k; },
        [&](int, int c) { return weight_row(w, n0 + c, n0 + c < n, k, BITS); });
}

extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 2)
    gemm_q4_split(const bf16* a, int m, Q4 w, int n, int k) {
    dense_split<4>(a, m, w, n, k);
}

extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 2)
    gemm_q8_split(const bf16* a, int m, Q4 w, int n, int k) {
    dense_split<8>(a, m, w, n, k);
}

// gemm_q4_split on the warpgroup tensor cores: block (256 weight rows, 128 activation rows, part of k), whose
// partial tile goes to the split products' slots as two 64-row tiles (row r of block row y is slot row
// (128 y + r) % 64 of tile row (128 y + r) / 64), so gemm_split_sum adds the parts as it adds gemm_q4_split's.
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1)
    gemm_q4_wgmma_split(const bf16* a, int m, Q4 w, int n, int k) {
#if WGMMA_BUILT
    const int m0 = blockIdx.y * WG_ROWS, n0 = blockIdx.x * WROWS;
    const int2 steps = split_steps(k / KT);
    const int tiles = gridDim.x * ((m + SPLIT_ROWS - 1) / SPLIT_ROWS);
    wgmma_tile<1, false, true, false>(
        min(WG_ROWS, m - m0), steps.x, steps.y - steps.x, [&](int r) { return a + (size_t)(m0 + r) * k; },
        [&](int i) { return weight_row(w, n0 + i, n0 + i < n, k, 4); },
        [&](int r, int c, float v0, float v1) {
            const int row = m0 + r;
            float* slot = partial_slot(blockIdx.x + gridDim.x * (row / SPLIT_ROWS), blockIdx.z, tiles);
            *(float2*)(slot + (row % SPLIT_ROWS) * WROWS + c) = make_float2(v0, v1);
        });
#else
    wait_previous();
    __trap();  // built without wgmma: the host never launches it (gemm_wgmma is 0)
#endif
}

// The sum over `parts` parts, in order, of the 4 partial columns `col` .. `col` + 3 of tile column block `cb` at
// output row r (columns numbered within the tile; the split launch had `col_blocks` x ceil(m / SPLIT_ROWS) tiles).
__device__ __forceinline__ float4 split_sum(int r, int cb, int col, int col_blocks, int m, int parts) {
    return split_parts_sum(gemm_partials, r, cb * WROWS + col, m, col_blocks * WROWS, parts);
}

// out[m][n] = the summed parts of gemm_q{4,8}_split (+= where `accumulate` is 1): thread i takes row
// i / ceil(n / 4), columns 4 (i % ceil(n / 4)) .. + 3.
extern "C" __global__ void __launch_bounds__(256)
    gemm_split_sum(int m, int n, int parts, float* out, int accumulate) {
    wait_previous();
    const int per_row = (n + 3) / 4;
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= m * per_row) return;
    const int r = i / per_row, col = 4 * (i % per_row);
    const float4 s = split_sum(r, col / WROWS, col % WROWS, (n + WROWS - 1) / WROWS, m, parts);
    const float v[4] = {s.x, s.y, s.z, s.w};
    float* o = out + (size_t)r * n + col;
#pragma unroll
    for (int e = 0; e < 4; e += 2) {
        if (col + e >= n) break;
        if (n % 2 == 0) {  // col + e even: the pair is whole and 8-byte aligned
            float2 x = make_float2(v[e], v[e + 1]);
            if (accumulate) {
                const float2 prev = *(const float2*)(o + e);
                x.x += prev.x, x.y += prev.y;
            }
            *(float2*)(o + e) = x;
        } else {
            o[e] = accumulate ? o[e] + v[e] : v[e];
            if (col + e + 1 < n) o[e + 1] = accumulate ? o[e + 1] + v[e + 1] : v[e + 1];
        }
    }
}

// Grouped expert products over the entries sorted by expert: a work item (column block, tile) takes one tile of
// up to T::BM sorted entries of one expert (the tile height the host sorted with). The large tiling launches
// gate/up and down as two grids of items; the small one runs both in one persistent launch (moe_small below).
//
// The weights are tiled (common.cuh), and every stage of both tilings is one piece: two quantization groups of
// the tile's 256 weight rows, read as one contiguous run a block of 128 rows.
//
// Two tilings. A long prompt has many entries per expert: 64-row tiles in two stages of a piece each (faster
// than four stages of half a piece). A batched decode step or a short prompt has a few entries per expert (t
// tokens give 8t / 256 on average): the small tiling at the end of this file, on the integer tensor cores.
// (These constants may be given as -D defines when tuning; see tuning_defines in src/kernels/mod.rs.)
#ifndef MOE_GROUPS
#define MOE_GROUPS 2
#endif
typedef Tile<MOE_TILE_ROWS, 2, 4, MOE_GROUPS, GEMM_STAGES / MOE_GROUPS, true> MoeGateUp;
typedef Tile<MOE_TILE_ROWS, 1, 4, MOE_GROUPS, GEMM_STAGES / MOE_GROUPS, true> MoeDown;
static_assert(HIDDEN % TILED_ROWS == 0 && MOE_INTER % TILED_ROWS == 0 && HIDDEN % TILED_PIECE == 0 &&
                  MOE_INTER % TILED_PIECE == 0 && WROWS == 2 * TILED_ROWS,
              "an expert is whole blocks of whole pieces; a gate/up item's rows of a matrix are one block, a down "
              "item's two (run_tile's two pitches)");

// The shared expert is expert NUM_EXPERTS of the grouped products (see route_rows in prefill.cu): a token's
// entries are token * MOE_SLOTS + slot, the shared expert's weights are its own matrices.

// Row `row` of expert e's block of a stacked expert matrix, or of the shared expert's matrix for e = NUM_EXPERTS
// (both tiled).
__device__ __forceinline__ WeightRow expert_row(Q4 experts, Q4 shared, int e, int rows, int row, bool valid, int k) {
    const bool routed = e < NUM_EXPERTS;
    const Q4 w = {routed ? experts.packed : shared.packed, routed ? experts.scale_bias : shared.scale_bias};
    return tiled_weight_row(w, (routed ? e * rows : 0) + row, valid, k);
}

// act[i][:] = bf16(silu(gate_e x[token]) * (up_e x[token])) for the sorted indices i of tile `tile`, token =
// entries[i] / MOE_SLOTS, output columns from column block `cb`.
template <class T>
__device__ __forceinline__ void moe_gate_up_tile(int tile, int cb, const bf16* x, const int* entries,
                                                 const int* tiles, const int* offsets, Q4 gate, Q4 up,
                                                 Q4 shared_gate, Q4 shared_up, bf16* act) {
    const int expert = tiles[2 * tile], first = tiles[2 * tile + 1];
    const int n0 = cb * T::BN;
    run_tile<T, false>(
        min(T::BM, offsets[expert + 1] - first), HIDDEN,
        [&](int r) { return x + (size_t)(entries[first + r] / MOE_SLOTS) * HIDDEN; },
        [&](int mat, int c) {
            return expert_row(mat ? up : gate, mat ? shared_up : shared_gate, expert, MOE_INTER, n0 + c, true, HIDDEN);
        },
        [&](int r, int c, float g0, float g1, float u0, float u1) {
            *(u32*)(act + (size_t)(first + r) * MOE_INTER + n0 + c) = swiglu_pair(g0, g1, u0, u1);
        });
}

// out[entries[i]][:] = route_w[entries[i]] * (down_e act[i]) for the sorted indices i of tile `tile`, output
// columns from column block `cb`.
// `part`: the tile's part of T::BM entries this block takes (tiles taller than T::BM: the warpgroup gate/up's).
template <class T>
__device__ __forceinline__ void moe_down_tile(int tile, int part, int cb, const bf16* act, const int* entries,
                                              const int* tiles, const int* offsets, const float* route_w, Q4 down,
                                              Q4 shared_down, bf16* out) {
    const int expert = tiles[2 * tile], first = tiles[2 * tile + 1] + part * T::BM;
    const int n0 = cb * T::BN, rows = min(T::BM, offsets[expert + 1] - first);
    if (rows <= 0) return;  // a partial tile's parts past its entries
    run_tile<T, false>(
        rows, MOE_INTER,
        [&](int r) { return act + (size_t)(first + r) * MOE_INTER; },
        [&](int, int c) { return expert_row(down, shared_down, expert, HIDDEN, n0 + c, n0 + c < HIDDEN, MOE_INTER); },
        [&](int r, int c, float v0, float v1) {
            const int col = n0 + c;
            if (col >= HIDDEN) return;
            const int entry = entries[first + r];
            const float weight = route_w[entry];
            *(u32*)(out + (size_t)entry * HIDDEN + col) = pack_bf16x2(weight * v0, weight * v1);
        });
}

// The large tiling: one launch for gate/up, then one for down, block (column block, tile); blocks past the
// routing's tile count return at once. Down also takes the warpgroup gate/up's 128-row tiles, as gridDim.z parts
// of 64 rows.
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 2)
    moe_gate_up(const bf16* x, const int* entries, const int* tiles, const int* tile_count, const int* offsets,
                Q4 gate, Q4 up, Q4 shared_gate, Q4 shared_up, bf16* act) {
    wait_previous();  // the tiles and the weights they pick come from the routing
    if ((int)blockIdx.y >= *tile_count) return;
    moe_gate_up_tile<MoeGateUp>(blockIdx.y, blockIdx.x, x, entries, tiles, offsets, gate, up, shared_gate, shared_up,
                                act);
}

extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 2)
    moe_down(const bf16* act, const int* entries, const int* tiles, const int* tile_count, const int* offsets,
             const float* route_w, Q4 down, Q4 shared_down, bf16* out) {
    wait_previous();
    if ((int)blockIdx.y >= *tile_count) return;
    moe_down_tile<MoeDown>(blockIdx.y, blockIdx.z, blockIdx.x, act, entries, tiles, offsets, route_w, down,
                           shared_down, out);
}

// The large tiling's gate/up on the warpgroup tensor cores (Hopper): tiles of 128 sorted entries (the sort's tile
// height is moe_wgmma_tile_rows there), a block a wgmma_tile; a warpgroup whose 64 rows of a tile are all empty
// skips its MMAs, so a tile costs its rows in steps of 64. Where the build has moe_gate_up_rs (below, MOE_RS), the
// routings long enough for these tiles take that kernel and its own tiles instead. Warpgroup accumulator blocks
// 0-15 are 128 columns of gate, 16-31 the same columns of up, so a thread holds both for its SwiGLU. Down stays on
// mma.sync (moe_down, a
// 128-row tile as two parts of 64 rows): its k of 512 is eight wgmma steps, too few to cover a tile's prologue and
// epilogue at one block an SM. Routings of at least MOE_WGMMA_MIN_TOKENS tokens take these tiles where the build
// has wgmma (MOE_WGMMA=0 keeps mma.sync's 64-row tiles for both); the selftest checks them on Hopper either way.
// Shorter routings keep the 64-row tiles: at 2,048 tokens an expert has ~72 entries, which fill one 128-row tile
// to 56% and two 64-row ones to 56% too, but mma.sync runs two blocks an SM.
#ifndef MOE_WGMMA
#define MOE_WGMMA 1
#endif
#ifndef MOE_WGMMA_MIN_TOKENS
#define MOE_WGMMA_MIN_TOKENS 8192
#endif
__device__ int moe_wgmma = WGMMA_BUILT && MOE_WGMMA;
__device__ int moe_wgmma_built = WGMMA_BUILT;
__device__ int moe_wgmma_tile_rows = WG_ROWS;
__device__ int moe_wgmma_min_tokens = MOE_WGMMA_MIN_TOKENS;

extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1)
    moe_gate_up_wgmma(const bf16* x, const int* entries, const int* tiles, const int* tile_count, const int* offsets,
                      Q4 gate, Q4 up, Q4 shared_gate, Q4 shared_up, bf16* act) {
    wait_previous();  // the tiles and the weights they pick come from the routing
#if WGMMA_BUILT
    // The count comes through a shuffle so ptxas knows the return is warp-uniform and does not serialize the MMAs.
    if ((int)blockIdx.y >= __shfl_sync(0xffffffffu, *tile_count, 0)) return;
    const int expert = tiles[2 * blockIdx.y], first = tiles[2 * blockIdx.y + 1];
    const int n0 = blockIdx.x * (WROWS / 2);
    wgmma_tile<2, true, false, true>(
        min(WG_ROWS, offsets[expert + 1] - first), 0, HIDDEN / KT,
        [&](int r) { return x + (size_t)(entries[first + r] / MOE_SLOTS) * HIDDEN; },
        [&](int i) {
            const bool is_up = i >= WROWS / 2;
            return expert_row(is_up ? up : gate, is_up ? shared_up : shared_gate, expert, MOE_INTER,
                              n0 + i % (WROWS / 2), true, HIDDEN);
        },
        [&](int r, int c, float g0, float g1, float u0, float u1) {
            *(u32*)(act + (size_t)(first + r) * MOE_INTER + n0 + c) = swiglu_pair(g0, g1, u0, u1);
        });
#else
    __trap();  // built without wgmma: the host never launches it (moe_wgmma is 0)
#endif
}

// ---- The experts' gate/up with the weights in registers (moe_gate_up_rs, Hopper) ----
// moe_gate_up_wgmma's product with gemm_q4_wgmma_rs's swap of operands: the weights are wgmma's A operand,
// dequantized by each consumer thread into registers, and the tile's gathered token rows its B operand
// (MOE_RS_TOKENS of them, 64 or 128: m64n64k16 or m64n128k16; the sort makes tiles of that height,
// moe_rs_tile_rows). Consumer warpgroup w takes columns 64 w .. 64 w + 63 of the block's 128, of gate and of up, so
// a thread holds both for its SwiGLU.
// The producer warpgroup only copies:
// - The token rows are gathered (a tile's rows are its entries' tokens), which a tensor copy cannot do. Each
//   producer thread copies 16-byte chunks of its rows with cp.async (zeros past the tile's entries) and then asks
//   for an arrival on the stage's barrier once they have landed. A stage's barrier thus completes after 129
//   arrivals (thread 0's, which announces the bulk copies' bytes, and the 128 threads' copies) and those bytes.
// - The weights are tiled (common.cuh): a piece's 128 rows are 8 KB of codes and 1 KB of pairs, each in one run.
//   Thread 0 copies a step's half of a piece of gate and of up with tensor copies (boxes of 32 bytes by 128 rows,
//   the codes' maps reading a tiled matrix as rows of 64 bytes) and, every piece, both matrices' pairs with two
//   bulk copies into a slot of their own (8 bytes a row).
// cp.async writes through the generic proxy, so each consumer thread fences its view of a stage before its MMAs.
// A thread's A registers hold one step (four k16 slices of gate and of up); the MMAs go in two halves of two slices,
// and a half is dequantized while the other half's MMAs run (wgmma_wait<1> frees the registers of the half issued
// before). The epilogue stages the SwiGLU tile in shared memory (token rows padded to 272 bytes, so a warp's writes
// of eight columns at four tokens fall in different banks) and stores each valid token row's 256 bytes with 16-byte
// writes. Routings of MOE_RS_MIN_TOKENS or more take this kernel. Tiles of 64 tokens would run fewer MMAs on the
// experts' partial tiles, but each block dequantizes the same weights for half the tokens: on the H100 the
// 4,096-token prefill's gate/up took 22.2 ms in 833 such tiles, 18.1 in 545 of 128.
#ifndef MOE_RS
#define MOE_RS 1
#endif
#ifndef MOE_RS_STAGES
#define MOE_RS_STAGES 6
#endif
#ifndef MOE_RS_TOKENS
#define MOE_RS_TOKENS 128
#endif
// Past the small tiling (from 513 tokens, an expert's ~18 entries a 128-token tile) this kernel is ahead of
// mma.sync's 64-row tiles on the H100: the 768-token prefill 4.5%, 1,024 tokens 3.9%, 1,536 tokens 7.3%.
#ifndef MOE_RS_MIN_TOKENS
#define MOE_RS_MIN_TOKENS 512
#endif
// The registers at launch go to the consumers as for gemm_q4_wgmma_rs, the producer keeping more (its threads hold
// their rows' offsets).
constexpr int MOE_RS_CONSUMER_REGS = 200;
constexpr int MOE_RS_PRODUCER_REGS = (RS_THREADS * RS_LAUNCH_REGS - 256 * MOE_RS_CONSUMER_REGS) / 128;  // 104
static_assert(MOE_RS_CONSUMER_REGS % 8 == 0 && MOE_RS_CONSUMER_REGS >= RS_LAUNCH_REGS &&
                  MOE_RS_PRODUCER_REGS % 8 == 0 && MOE_RS_PRODUCER_REGS >= 24,
              "register counts setmaxnreg takes; the consumers gain registers, the producer gives them up");
constexpr int MOE_RS_PAIR_SLOTS = 4;
constexpr int MOE_RS_PAIRS = WROWS * 8;              // one piece's pairs of the tile's 256 weight rows
constexpr int MOE_RS_X = MOE_RS_TOKENS * 128;       // the token rows' step, 128-byte swizzled
constexpr int MOE_RS_STAGE = MOE_RS_X + WROWS * 32;  // and the codes of 128 rows of gate and of up
constexpr int MOE_RS_ROW = 272;             // a staged output row: 128 bf16 and 16 bytes of padding
constexpr int MOE_RS_SMEM =
    MOE_RS_STAGES * MOE_RS_STAGE + MOE_RS_PAIR_SLOTS * MOE_RS_PAIRS + 2 * MOE_RS_STAGES * 8 + 1024;
static_assert((MOE_RS_TOKENS == 64 || MOE_RS_TOKENS == 128) && MOE_RS_STAGE % 1024 == 0,
              "a width wgmma_m64k16_rs takes; a stage's token rows start on a swizzle atom");
// Piece p's pairs are copied with step 2p once step 2p - stages is done; the slot's last reader is step
// 2 (p - slots) + 1.
static_assert(MOE_RS_STAGES + 1 <= 2 * MOE_RS_PAIR_SLOTS, "a pairs' slot is refilled after its last reader");
static_assert(MOE_RS_SMEM <= 227 * 1024 && MOE_RS_TOKENS * MOE_RS_ROW <= MOE_RS_STAGES * MOE_RS_STAGE,
              "a block's shared memory on Hopper; the staged tile fits over the stages");
__device__ int moe_rs = WGMMA_BUILT && MOE_RS;
__device__ int moe_rs_smem = MOE_RS_SMEM;
__device__ int moe_rs_tile_rows = MOE_RS_TOKENS;
__device__ int moe_rs_min_tokens = MOE_RS_MIN_TOKENS;

// MOE_RS_NARROW 1 runs a tile of at most 64 token rows (an expert's last tile, about half the time) on the narrowest
// of m64n16k16, m64n32k16 and m64n64k16 that holds its rows: fewer MMAs and row copies on the same dequantized
// weights. Each block picks the width from its tile's rows (moe_rs_width), so all widths share one launch (and its
// waves); moe_down_rs takes the same widths. 0 runs every tile on MOE_RS_TOKENS rows.
#ifndef MOE_RS_NARROW
#define MOE_RS_NARROW 1
#endif
__device__ int moe_rs_narrow = WGMMA_BUILT && MOE_RS && MOE_RS_NARROW && MOE_RS_TOKENS == 128;
constexpr bool MOE_RS_WIDTHS = MOE_RS_NARROW && MOE_RS_TOKENS == 128;

// The token rows the MMAs of a tile of `rows` rows run on: 16, 32, 64, or MOE_RS_TOKENS.
__device__ __forceinline__ int moe_rs_width(int rows) {
    if (!MOE_RS_WIDTHS) return MOE_RS_TOKENS;
    return rows <= 16 ? 16 : rows <= 32 ? 32 : rows <= 64 ? 64 : MOE_RS_TOKENS;
}

// moe_gate_up_rs's work for its block's tile with wgmma N = the token rows the MMAs run on (MOE_RS_TOKENS). Where
// NARROW, a tile of at most 64 rows goes on with N = moe_rs_width(rows) instead (the prologue before that choice is
// the same).
template <int N, bool NARROW>
__device__ __forceinline__ void moe_gate_up_rs_tile(const TmaMap& gate_map, const TmaMap& up_map,
                                                    const TmaMap& shared_gate_map, const TmaMap& shared_up_map,
                                                    const bf16* x, const int* entries, const int* tiles,
                                                    const int* tile_count, const int* offsets, Q4 gate, Q4 up,
                                                    Q4 shared_gate, Q4 shared_up, bf16* act) {
#if WGMMA_BUILT
    static_assert(N == MOE_RS_TOKENS || (N <= 64 && !NARROW), "a width wgmma_m64k16_rs takes, within the tile");
    extern __shared__ __align__(128) unsigned char moe_rs_raw[];
    // The host's launch is not the kernel's.
    if (dynamic_smem_bytes() < MOE_RS_SMEM || blockDim.x != RS_THREADS) __trap();
    wait_previous();  // the tiles and the weights they pick come from the routing
    // The count comes through a shuffle so ptxas knows the return is warp-uniform (as in moe_gate_up_wgmma).
    if ((int)blockIdx.y >= __shfl_sync(0xffffffffu, *tile_count, 0)) return;
    constexpr int STAGES = MOE_RS_STAGES, K_TILES = HIDDEN / KT;
    const u32 raw0 = smem_addr(moe_rs_raw), smem0 = (raw0 + 1023) & ~1023u;
    unsigned char* smem = moe_rs_raw + (smem0 - raw0);
    const u32 pairs0 = smem0 + STAGES * MOE_RS_STAGE;
    const u32 full = pairs0 + MOE_RS_PAIR_SLOTS * MOE_RS_PAIRS, empty = full + 8 * STAGES;
    const int tid = threadIdx.x, lane = tid % WARP;
    const int expert = tiles[2 * blockIdx.y], first = tiles[2 * blockIdx.y + 1];
    const int rows = min(MOE_RS_TOKENS, offsets[expert + 1] - first);
    if constexpr (NARROW) {
        // The width is the same for the whole block (through a shuffle, so ptxas knows it is warp-uniform); the
        // narrow tile's run repeats the prologue up to here, which reads the same values.
        const int width = __shfl_sync(0xffffffffu, moe_rs_width(rows), 0);
        if (width == 16) {
            moe_gate_up_rs_tile<16, false>(gate_map, up_map, shared_gate_map, shared_up_map, x, entries, tiles,
                                           tile_count, offsets, gate, up, shared_gate, shared_up, act);
            return;
        }
        if (width == 32) {
            moe_gate_up_rs_tile<32, false>(gate_map, up_map, shared_gate_map, shared_up_map, x, entries, tiles,
                                           tile_count, offsets, gate, up, shared_gate, shared_up, act);
            return;
        }
        if (width == 64) {
            moe_gate_up_rs_tile<64, false>(gate_map, up_map, shared_gate_map, shared_up_map, x, entries, tiles,
                                           tile_count, offsets, gate, up, shared_gate, shared_up, act);
            return;
        }
    }
    const int n0 = blockIdx.x * (WROWS / 2);

    if (tid == 0) {
        for (int s = 0; s < STAGES; s++) {
            mbarrier_init(full + 8 * s, 1 + 128);
            mbarrier_init(empty + 8 * s, 8);
        }
        mbarrier_init_fence();
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // and to the copies' proxy
    }
    __syncthreads();  // the barriers are initialised

    if (tid < 128) {
        // The producer.
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(MOE_RS_PRODUCER_REGS) : "memory");
        const bool routed = expert < NUM_EXPERTS;
        const int row0 = (routed ? expert * MOE_INTER : 0) + n0;
        const int map_row0 = row0 / TILED_ROWS * (HIDDEN / TILED_PIECE) * TILED_ROWS;
        const TmaMap* g_map = routed ? &gate_map : &shared_gate_map;
        const TmaMap* u_map = routed ? &up_map : &shared_up_map;
        const u32* g_pairs = tiled_row_pairs(routed ? gate : shared_gate, row0, HIDDEN);
        const u32* u_pairs = tiled_row_pairs(routed ? up : shared_up, row0, HIDDEN);
        auto copy_w = [&](int kt) {
            const u32 bar = full + 8 * (kt % STAGES), stage = smem0 + (kt % STAGES) * MOE_RS_STAGE;
            const int piece = kt / 2;
            mbarrier_arrive_expect(bar, WROWS * 32 + (kt % 2 == 0 ? MOE_RS_PAIRS : 0));
            const int y = map_row0 + piece * TILED_ROWS, half = (kt % 2) * (KT / 2);
            tma_load_2d(stage + MOE_RS_X, *g_map, half, y, bar);
            tma_load_2d(stage + MOE_RS_X + TILED_ROWS * 32, *u_map, half, y, bar);
            if (kt % 2 == 0) {
                const u32 slot = pairs0 + (piece % MOE_RS_PAIR_SLOTS) * MOE_RS_PAIRS;
                bulk_load(slot, g_pairs + piece * TILED_PAIR_STEP, TILED_ROWS * 8, bar);
                bulk_load(slot + TILED_ROWS * 8, u_pairs + piece * TILED_PAIR_STEP, TILED_ROWS * 8, bar);
            }
        };
        constexpr int A_ROWS = N / 16;  // a thread's token rows (those the MMAs read)
        const int a_chunk = tid % 8, a_first = tid / 8;
        u32 a_from[A_ROWS], a_valid = 0;
#pragma unroll
        for (int i = 0; i < A_ROWS; i++) {
            const int r = a_first + 16 * i;
            a_from[i] = r < rows ? (u32)(entries[first + r] / MOE_SLOTS) * HIDDEN + a_chunk * 8 : 0u;
            a_valid |= (r < rows ? 1u : 0u) << i;
        }
        const u32 a_dst = a_first * 128 + ((a_chunk ^ (a_first % 8)) << 4);
#pragma unroll 1
        for (int kt = 0; kt < K_TILES; kt++) {
            if (kt >= STAGES) mbarrier_wait(empty + 8 * (kt % STAGES), (kt / STAGES - 1) % 2);
            if (tid == 0) copy_w(kt);
            const u32 stage = smem0 + (kt % STAGES) * MOE_RS_STAGE + a_dst;
#pragma unroll
            for (int i = 0; i < A_ROWS; i++)
                cp_async_16(stage + i * 16 * 128, x + a_from[i] + kt * KT, (a_valid >> i) & 1u ? 16u : 0u);
            cp_async_arrive(full + 8 * (kt % STAGES));
        }
        // The copies land before the thread leaves (the arrivals they owe would otherwise outlive it).
        asm volatile("cp.async.wait_all;" ::: "memory");
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(MOE_RS_CONSUMER_REGS) : "memory");
    const int ct = tid - 128, wg = ct / 128, q = (ct % 128) / WARP, g = lane / 4, t = lane % 4;
    const int c0 = wg * 64 + q * 16 + g;  // this thread's columns: c0 and c0 + 8 of the block's 128
    const u32 sel = 0x0400u + 0x0101u * (u32)t;  // byte t of a word: inputs 2t, 2t + 1
    constexpr int ACC = N / 2;
    float dg[ACC], du[ACC];
#pragma unroll
    for (int i = 0; i < ACC; i++) dg[i] = 0.f, du[i] = 0.f;
    u32 a[2][2][2][4];  // [half][slice of the half][gate, up][fragment]
    // Half `half` of step kt: its two slices' fragments of gate and up, dequantized from the stage.
    auto dequant = [&](int kt, int half, u32 (&ah)[2][2][4]) {
        const unsigned char* codes = smem + (kt % STAGES) * MOE_RS_STAGE + MOE_RS_X;
        const unsigned char* pairs =
            smem + (pairs0 - smem0) + ((kt / 2) % MOE_RS_PAIR_SLOTS) * MOE_RS_PAIRS + (kt % 2) * 4;
#pragma unroll
        for (int mat = 0; mat < 2; mat++) {
            const int r0 = mat * TILED_ROWS + c0;
            const u32 sb0 = *(const u32*)(pairs + r0 * 8), sb1 = *(const u32*)(pairs + (r0 + 8) * 8);
            const u32 scale0 = __byte_perm(sb0, sb0, 0x1010), bias0 = __byte_perm(sb0, sb0, 0x3232);
            const u32 scale1 = __byte_perm(sb1, sb1, 0x1010), bias1 = __byte_perm(sb1, sb1, 0x3232);
            const uint4 w0 = *(const uint4*)(codes + r0 * 32 + half * 16);
            const uint4 w1 = *(const uint4*)(codes + (r0 + 8) * 32 + half * 16);
#pragma unroll
            for (int s = 0; s < 2; s++) {
                ah[s][mat][0] = dequant_q4(word_of(w0, 2 * s), sel, scale0, bias0);
                ah[s][mat][1] = dequant_q4(word_of(w1, 2 * s), sel, scale1, bias1);
                ah[s][mat][2] = dequant_q4(word_of(w0, 2 * s + 1), sel, scale0, bias0);
                ah[s][mat][3] = dequant_q4(word_of(w1, 2 * s + 1), sel, scale1, bias1);
            }
        }
    };
    auto mma = [&](int kt, int half, const u32 (&ah)[2][2][4]) {
        const u32 x_tile = smem0 + (kt % STAGES) * MOE_RS_STAGE;
        wgmma_fence();
        wgmma_hold(dg);
        wgmma_hold(du);
#pragma unroll
        for (int s = 0; s < 2; s++) {
            const u64 desc = wgmma_desc(x_tile + 32 * (2 * half + s));
            wgmma_m64k16_rs<N>(dg, ah[s][0], desc);
            wgmma_m64k16_rs<N>(du, ah[s][1], desc);
        }
        wgmma_commit();
    };
    // Half-steps in order; before dequantizing half h into its registers, the MMAs of half h - 2 (which read them)
    // must be complete, and at a step's first half its stage must have landed. A stage is released once both of
    // its halves' MMAs are complete, i.e. after the wait in the next step's second half.
#pragma unroll 1
    for (int kt = 0; kt < K_TILES; kt++) {
        mbarrier_wait(full + 8 * (kt % STAGES), (kt / STAGES) % 2);
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the producer's cp.async rows, for wgmma
        wgmma_wait<1>();  // the MMAs of step kt - 1's first half are complete
        wgmma_hold(dg);
        wgmma_hold(du);
        dequant(kt, 0, a[0]);
        mma(kt, 0, a[0]);
        wgmma_wait<1>();  // step kt - 1's second half is complete, so its stage is free
        wgmma_hold(dg);
        wgmma_hold(du);
        if (kt > 0 && lane == 0) mbarrier_arrive(empty + 8 * ((kt - 1) % STAGES));
        dequant(kt, 1, a[1]);
        mma(kt, 1, a[1]);
    }
    wgmma_wait<0>();
    wgmma_hold(dg);
    wgmma_hold(du);

    // The epilogue: the SwiGLU of column c0 (+ 8 h) at token 8 j + 2 t (+ e), registers 4 j + 2 h (+ e), staged by
    // token row, then each valid token row copied out in 16-byte chunks.
    asm volatile("bar.sync 1, 256;" ::: "memory");  // both consumers' MMAs are done with the stages
#pragma unroll
    for (int h = 0; h < 2; h++) {
#pragma unroll
        for (int j = 0; j < N / 8; j++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int i = 4 * j + 2 * h + e, r = 8 * j + 2 * t + e;
                const bf16 v = float_to_bf16(siluf_(dg[i]) * du[i]);  // as swiglu_pair
                *(bf16*)(smem + r * MOE_RS_ROW + (c0 + 8 * h) * 2) = v;
            }
        }
    }
    asm volatile("bar.sync 1, 256;" ::: "memory");
    for (int i = ct; i < rows * 16; i += 256) {
        const int r = i / 16, chunk = i % 16;
        *(uint4*)(act + (size_t)(first + r) * MOE_INTER + n0 + chunk * 8) =
            *(const uint4*)(smem + r * MOE_RS_ROW + chunk * 16);
    }
#else
    wait_previous();
    __trap();  // built without wgmma: the host never launches it (moe_rs is 0)
#endif
}

extern "C" __global__ void __launch_bounds__(RS_THREADS, 1)
    moe_gate_up_rs(const __grid_constant__ TmaMap gate_map, const __grid_constant__ TmaMap up_map,
                   const __grid_constant__ TmaMap shared_gate_map, const __grid_constant__ TmaMap shared_up_map,
                   const bf16* x, const int* entries, const int* tiles, const int* tile_count, const int* offsets,
                   Q4 gate, Q4 up, Q4 shared_gate, Q4 shared_up, bf16* act) {
    constexpr bool NARROW = MOE_RS_WIDTHS;
    moe_gate_up_rs_tile<MOE_RS_TOKENS, NARROW>(gate_map, up_map, shared_gate_map, shared_up_map, x, entries, tiles,
                                               tile_count, offsets, gate, up, shared_gate, shared_up, act);
}

// ---- The experts' down with the weights in registers (moe_down_rs, Hopper) ----
// The down product of moe_gate_up_rs's tiles, in the same operand roles: the down weights are wgmma's A operand,
// dequantized into registers by each consumer thread one step ahead of its MMAs, and the tile's SwiGLU rows the B
// operand (m64nTk16 with T = MOE_RS_TOKENS). A work item is (tile, column block of 128 hidden rows); consumer
// warpgroup w takes the block's hidden rows 64 w .. 64 w + 63 against the tile's token rows.
// A tile's SwiGLU rows are consecutive rows of `act` (sorted entries), so one tensor copy brings a step's activation
// box (64 inputs by the tile's rows, 128-byte swizzle); rows past the tile belong to the next expert's entries or
// lie past the matrix (zero-filled), and only the token columns they feed, which the epilogue drops, see them.
// k is MOE_INTER (512): eight steps, too few to hide a block's prologue and epilogue, so the kernel is persistent:
// a block an SM walks the items (gridDim.x apart), and the producer's copies run on into the next item while the
// consumers finish the last one. Stages and barrier phases count steps over all of a block's items.
// An item's MMAs run on the width of its tile's rows (moe_rs_width: 16, 32, 64 or all MOE_RS_TOKENS), and the
// producer brings only those rows, in boxes of MOE_DOWN_RS_BOX_ROWS rows where the width is narrower; the consumers
// learn the width from the item's table (below).
// The epilogue stages the tile, transposed to token rows, in shared memory of its own (so the next item's stages
// can fill meanwhile), then writes each valid token's 128 weighted columns to its entry's row of `out` in 16-byte
// stores, as moe_down writes them. Which entry a token row is and its routing weight come from a table that the
// producer's other warps fill for each item ahead of its epilogue (two tables, by item parity, each released by
// the consumers once they have read it), so the consumers wait on no global load between their MMAs.
// MOE_DOWN_RS 1 gives moe_gate_up_rs's tiles' down product to this kernel, 0 to moe_down (mma.sync): it makes the
// 4,096-token prefill about 5% faster on the H200 (bench/RESULTS.md).
#ifndef MOE_DOWN_RS
#define MOE_DOWN_RS 1
#endif
#ifndef MOE_DOWN_RS_STAGES
#define MOE_DOWN_RS_STAGES 6
#endif
constexpr int MOE_DOWN_RS_COLS = 128;                                   // hidden rows of an item (two m64)
constexpr int MOE_DOWN_RS_COL_BLOCKS = HIDDEN / MOE_DOWN_RS_COLS;
constexpr int MOE_DOWN_RS_STEPS = MOE_INTER / KT;                       // k steps of an item
constexpr int MOE_DOWN_RS_X = MOE_RS_TOKENS * 128;                      // the activation box of a step
constexpr int MOE_DOWN_RS_BOX_ROWS = 16;  // the rows of a narrower tile's activation boxes (act_box_map)
constexpr int MOE_DOWN_RS_STAGE = MOE_DOWN_RS_X + MOE_DOWN_RS_COLS * 32;  // and the codes of 128 rows
constexpr int MOE_DOWN_RS_PAIRS = MOE_DOWN_RS_COLS * 8;                 // a piece's pairs of 128 rows
constexpr int MOE_DOWN_RS_PAIR_SLOTS = 4;
constexpr int MOE_DOWN_RS_ROW = MOE_DOWN_RS_COLS * 4 + 16;              // a staged token row: 128 f32 and padding
// An item's table: (entry, routing weight) of each token row, then the item's count of valid rows.
constexpr int MOE_DOWN_RS_TABLE = MOE_RS_TOKENS * 8 + 16;
constexpr int MOE_DOWN_RS_TABLE_THREADS = 96;  // the producer's warps 1 to 3
constexpr int MOE_DOWN_RS_SMEM = MOE_DOWN_RS_STAGES * MOE_DOWN_RS_STAGE + MOE_DOWN_RS_PAIR_SLOTS * MOE_DOWN_RS_PAIRS +
                                 MOE_RS_TOKENS * MOE_DOWN_RS_ROW + 2 * MOE_DOWN_RS_TABLE +
                                 (2 * MOE_DOWN_RS_STAGES + 4) * 8 + 1024;
static_assert(HIDDEN % MOE_DOWN_RS_COLS == 0 && MOE_DOWN_RS_COLS == TILED_ROWS && MOE_INTER % TILED_PIECE == 0 &&
                  TILED_PIECE == 2 * KT,
              "an item's rows are one block of the tiled matrix, and a piece is two steps");
static_assert(MOE_DOWN_RS_STAGE % 1024 == 0 && (MOE_DOWN_RS_BOX_ROWS * 128) % 1024 == 0,
              "every activation box starts on a swizzle atom");
static_assert(16 % MOE_DOWN_RS_BOX_ROWS == 0, "the narrower widths (moe_rs_width) are whole boxes");
static_assert(MOE_DOWN_RS_STEPS % 2 == 0, "the consumers take an item's steps in pairs");
static_assert(MOE_DOWN_RS_TABLE_THREADS == 128 - WARP, "the producer's warps but the first fill the tables");
// Piece p's pairs' slot is refilled for piece p + slots, at step 2 (p + slots), once step 2 (p + slots) - stages is
// complete; its last reader, step 2 p + 1, must be no later.
static_assert(MOE_DOWN_RS_STAGES >= 2 && MOE_DOWN_RS_STAGES + 1 <= 2 * MOE_DOWN_RS_PAIR_SLOTS,
              "a pairs' slot is refilled after its last reader");
static_assert(MOE_DOWN_RS_SMEM <= 227 * 1024, "a block's shared memory on Hopper");
// The consumers hold half the dense kernel's accumulators, so the producer, whose thread 0 walks the items and whose
// other warps fill the tables, keeps more registers than RS_PRODUCER_REGS.
constexpr int MOE_DOWN_RS_PRODUCER_REGS = 56;
constexpr int MOE_DOWN_RS_CONSUMER_REGS = (RS_THREADS * RS_LAUNCH_REGS - 128 * MOE_DOWN_RS_PRODUCER_REGS) / 256 / 8 * 8;
static_assert(MOE_DOWN_RS_CONSUMER_REGS >= RS_LAUNCH_REGS, "the consumers gain registers, the producer gives them up");
// Read by the host (the kernel has the name moe_down_rs).
__device__ int moe_rs_down = WGMMA_BUILT && MOE_DOWN_RS;
__device__ int moe_down_rs_smem = MOE_DOWN_RS_SMEM;
__device__ int moe_down_rs_col_blocks = MOE_DOWN_RS_COL_BLOCKS;
__device__ int moe_down_rs_box_rows = MOE_DOWN_RS_BOX_ROWS;

#if WGMMA_BUILT
// A consumer thread of moe_down_rs: where its block's shared memory and barriers lie, and which rows it holds.
struct MoeDownRsConsumer {
    unsigned char* smem;  // at smem0
    u32 smem0, pairs0, staged0, full, empty, table_empty;
    int row0, lane, ct, t;  // weight rows row0 and row0 + 8 of the item's 128; lane (g, t); index among consumers
    u32 sel;
    bf16* out;

    // Step `step`'s A fragments of its four k16 slices, dequantized from its stage's codes (after its barrier).
    __device__ __forceinline__ void dequant(int step, u32 (&a)[4][4]) const {
        constexpr int STAGES = MOE_DOWN_RS_STAGES;
        mbarrier_wait(full + 8 * (step % STAGES), (step / STAGES) % 2);
        const unsigned char* codes = smem + (step % STAGES) * MOE_DOWN_RS_STAGE + MOE_DOWN_RS_X;
        const unsigned char* pairs =
            smem + (pairs0 - smem0) + (step / 2 % MOE_DOWN_RS_PAIR_SLOTS) * MOE_DOWN_RS_PAIRS + (step % 2) * 4;
        const uint4 lo0 = *(const uint4*)(codes + row0 * 32), hi0 = *(const uint4*)(codes + row0 * 32 + 16);
        const uint4 lo1 = *(const uint4*)(codes + (row0 + 8) * 32), hi1 = *(const uint4*)(codes + (row0 + 8) * 32 + 16);
        const u32 sb0 = *(const u32*)(pairs + row0 * 8), sb1 = *(const u32*)(pairs + (row0 + 8) * 8);
        const u32 scale0 = __byte_perm(sb0, sb0, 0x1010), bias0 = __byte_perm(sb0, sb0, 0x3232);
        const u32 scale1 = __byte_perm(sb1, sb1, 0x1010), bias1 = __byte_perm(sb1, sb1, 0x3232);
#pragma unroll
        for (int s = 0; s < KT / 16; s++) {
            const u32 w0a = word_of(s < 2 ? lo0 : hi0, (2 * s) % 4), w0b = word_of(s < 2 ? lo0 : hi0, (2 * s + 1) % 4);
            const u32 w1a = word_of(s < 2 ? lo1 : hi1, (2 * s) % 4), w1b = word_of(s < 2 ? lo1 : hi1, (2 * s + 1) % 4);
            a[s][0] = dequant_q4(w0a, sel, scale0, bias0);
            a[s][1] = dequant_q4(w1a, sel, scale1, bias1);
            a[s][2] = dequant_q4(w0b, sel, scale0, bias0);
            a[s][3] = dequant_q4(w1b, sel, scale1, bias1);
        }
    }

    // Item `it`, the block's n-th (its steps from `step` on), with wgmma N = the token rows its MMAs run on (the
    // width of its tile's `rows`): the MMAs, then the epilogue from its table `table`.
    template <int N>
    __device__ __forceinline__ void item(int it, int step, int n, const unsigned char* table, int rows) const {
        constexpr int STAGES = MOE_DOWN_RS_STAGES, STEPS = MOE_DOWN_RS_STEPS, ACC = N / 2;
        float d[ACC];
        // Step `step` (the item's kt-th) from fragments a; then, once the item's step before has completed, that
        // step's stage is released.
        auto mma = [&](int step, int kt, const u32 (&a)[4][4]) {
            const u32 x_tile = smem0 + (step % STAGES) * MOE_DOWN_RS_STAGE;
            wgmma_fence();
            wgmma_hold(d);
#pragma unroll
            for (int s = 0; s < KT / 16; s++) wgmma_m64k16_rs<N>(d, a[s], wgmma_desc(x_tile + 32 * s));
            wgmma_commit();
            wgmma_wait<1>();
            wgmma_hold(d);
            if (kt > 0 && lane == 0) mbarrier_arrive(empty + 8 * ((step - 1) % STAGES));
        };
        u32 a0[4][4], a1[4][4];
#pragma unroll
        for (int i = 0; i < ACC; i++) d[i] = 0.f;
        dequant(step, a0);
#pragma unroll 1
        for (int kt = 0; kt < STEPS; kt += 2) {
            mma(step + kt, kt, a0);
            dequant(step + kt + 1, a1);
            mma(step + kt + 1, kt + 1, a1);
            if (kt + 2 < STEPS) dequant(step + kt + 2, a0);
        }
        wgmma_wait<0>();
        wgmma_hold(d);
        if (lane == 0) mbarrier_arrive(empty + 8 * ((step + STEPS - 1) % STAGES));

        // The epilogue: d holds weight rows row0 (+ 8 h) at token rows 8 j + 2 t (+ e), registers 4 j + 2 h (+ e),
        // staged by token row once every consumer has copied the last item's rows out.
        asm volatile("bar.sync 1, 256;" ::: "memory");
#pragma unroll
        for (int h = 0; h < 2; h++) {
#pragma unroll
            for (int j = 0; j < N / 8; j++) {
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const u32 dst = staged0 + (8 * j + 2 * t + e) * MOE_DOWN_RS_ROW + (row0 + 8 * h) * 4;
                    asm volatile("st.shared.f32 [%0], %1;" ::"r"(dst), "f"(d[4 * j + 2 * h + e]) : "memory");
                }
            }
        }
        asm volatile("bar.sync 1, 256;" ::: "memory");
        const int n0 = it % MOE_DOWN_RS_COL_BLOCKS * MOE_DOWN_RS_COLS;
        for (int i = ct; i < rows * (MOE_DOWN_RS_COLS / 8); i += 256) {
            const int r = i / (MOE_DOWN_RS_COLS / 8), chunk = i % (MOE_DOWN_RS_COLS / 8);
            const int2 row = *(const int2*)(table + r * 8);
            const float weight = __int_as_float(row.y);
            // Each quarter-warp's first loads fall in all 32 banks: chunks 4 to 7 take their upper half first.
            const unsigned char* staged = smem + (staged0 - smem0) + r * MOE_DOWN_RS_ROW + chunk * 32;
            const int upper = (chunk / 4) % 2 * 16;
            const float4 first = *(const float4*)(staged + upper), second = *(const float4*)(staged + 16 - upper);
            const float4 v = upper ? second : first, w = upper ? first : second;
            *(uint4*)(out + (size_t)row.x * HIDDEN + n0 + chunk * 8) =
                make_uint4(pack_bf16x2(v.x * weight, v.y * weight), pack_bf16x2(v.z * weight, v.w * weight),
                           pack_bf16x2(w.x * weight, w.y * weight), pack_bf16x2(w.z * weight, w.w * weight));
        }
        __syncwarp();
        if (lane == 0) mbarrier_arrive(table_empty + 8 * (n % 2));  // this warp is done with the table
    }
};
#endif

extern "C" __global__ void __launch_bounds__(RS_THREADS, 1)
    moe_down_rs(const __grid_constant__ TmaMap act_map, const __grid_constant__ TmaMap act_box_map,
                const __grid_constant__ TmaMap down_map,
                const __grid_constant__ TmaMap shared_down_map, const int* entries, const int* tiles,
                const int* tile_count, const int* offsets, const float* route_w, Q4 down, Q4 shared_down,
                bf16* out) {
#if WGMMA_BUILT
    extern __shared__ __align__(128) unsigned char moe_down_rs_raw[];
    // The host's launch is not the kernel's.
    if (dynamic_smem_bytes() < MOE_DOWN_RS_SMEM || blockDim.x != RS_THREADS) __trap();
    wait_previous();  // the tiles, and the SwiGLU rows, come from the kernels before
    constexpr int STAGES = MOE_DOWN_RS_STAGES, STEPS = MOE_DOWN_RS_STEPS;
    const u32 raw0 = smem_addr(moe_down_rs_raw), smem0 = (raw0 + 1023) & ~1023u;
    unsigned char* smem = moe_down_rs_raw + (smem0 - raw0);
    const u32 pairs0 = smem0 + STAGES * MOE_DOWN_RS_STAGE;
    const u32 staged0 = pairs0 + MOE_DOWN_RS_PAIR_SLOTS * MOE_DOWN_RS_PAIRS;
    const u32 table0 = staged0 + MOE_RS_TOKENS * MOE_DOWN_RS_ROW;
    const u32 full = table0 + 2 * MOE_DOWN_RS_TABLE, empty = full + 8 * STAGES;
    const u32 table_full = empty + 8 * STAGES, table_empty = table_full + 16;
    const int tid = threadIdx.x, lane = tid % WARP;
    // The count comes through a shuffle so ptxas knows the loop bound is warp-uniform.
    const int items = __shfl_sync(0xffffffffu, *tile_count, 0) * MOE_DOWN_RS_COL_BLOCKS;

    if (tid == 0) {
        for (int s = 0; s < STAGES; s++) {
            mbarrier_init(full + 8 * s, 1);
            mbarrier_init(empty + 8 * s, 8);
        }
        for (int s = 0; s < 2; s++) {
            mbarrier_init(table_full + 8 * s, MOE_DOWN_RS_TABLE_THREADS);
            mbarrier_init(table_empty + 8 * s, 8);
        }
        mbarrier_init_fence();
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // and to the copies' proxy
    }
    __syncthreads();  // the barriers are initialised

    if (tid < 128) {
        // The producer: thread 0 brings every step of the block's items, each stage once the consumers are done
        // with its previous step; warps 1 to 3 fill each item's table once the consumers are done with the one
        // two items before.
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(MOE_DOWN_RS_PRODUCER_REGS) : "memory");
        if (tid >= WARP) {
            const int h = tid - WARP;
            int n = 0;
#pragma unroll 1
            for (int item = blockIdx.x; item < items; item += gridDim.x, n++) {
                if (n >= 2) mbarrier_wait(table_empty + 8 * (n % 2), (n / 2 - 1) % 2);
                const int tile = item / MOE_DOWN_RS_COL_BLOCKS;
                const int expert = tiles[2 * tile], first = tiles[2 * tile + 1];
                const int rows = min(MOE_RS_TOKENS, offsets[expert + 1] - first);
                unsigned char* table = smem + (table0 - smem0) + (n % 2) * MOE_DOWN_RS_TABLE;
                for (int r = h; r < rows; r += MOE_DOWN_RS_TABLE_THREADS) {
                    const int entry = entries[first + r];
                    *(int2*)(table + r * 8) = make_int2(entry, __float_as_int(route_w[entry]));
                }
                if (h == 0) *(int*)(table + MOE_RS_TOKENS * 8) = rows;
                mbarrier_arrive(table_full + 8 * (n % 2));  // releases this thread's writes
            }
        } else if (tid == 0) {
            int step = 0;
#pragma unroll 1
            for (int item = blockIdx.x; item < items; item += gridDim.x) {
                const int tile = item / MOE_DOWN_RS_COL_BLOCKS, cb = item % MOE_DOWN_RS_COL_BLOCKS;
                const int expert = tiles[2 * tile], first = tiles[2 * tile + 1];
                const int width = moe_rs_width(min(MOE_RS_TOKENS, offsets[expert + 1] - first));
                const bool routed = expert < NUM_EXPERTS;
                const int row0 = (routed ? expert * HIDDEN : 0) + cb * MOE_DOWN_RS_COLS;
                const int map_row0 = row0 / TILED_ROWS * (MOE_INTER / TILED_PIECE) * TILED_ROWS;
                const TmaMap* w_map = routed ? &down_map : &shared_down_map;
                const u32* pairs = tiled_row_pairs(routed ? down : shared_down, row0, MOE_INTER);
#pragma unroll 1
                for (int kt = 0; kt < STEPS; kt++, step++) {
                    const int s = step % STAGES;
                    if (step >= STAGES) mbarrier_wait(empty + 8 * s, (step / STAGES - 1) % 2);
                    const u32 bar = full + 8 * s, stage = smem0 + s * MOE_DOWN_RS_STAGE;
                    mbarrier_arrive_expect(
                        bar, width * 128 + MOE_DOWN_RS_COLS * 32 + (kt % 2 == 0 ? MOE_DOWN_RS_PAIRS : 0));
                    tma_load_2d(stage + MOE_DOWN_RS_X, *w_map, (kt % 2) * (KT / 2), map_row0 + kt / 2 * TILED_ROWS,
                                bar);
                    if (kt % 2 == 0)
                        bulk_load(pairs0 + (step / 2 % MOE_DOWN_RS_PAIR_SLOTS) * MOE_DOWN_RS_PAIRS,
                                  pairs + kt / 2 * TILED_PAIR_STEP, MOE_DOWN_RS_PAIRS, bar);
                    if (width == MOE_RS_TOKENS) {
                        tma_load_2d(stage, act_map, kt * KT, first, bar);
                    } else {
                        for (int r = 0; r < width; r += MOE_DOWN_RS_BOX_ROWS)
                            tma_load_2d(stage + r * 128, act_box_map, kt * KT, first + r, bar);
                    }
                }
            }
        }
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(MOE_DOWN_RS_CONSUMER_REGS) : "memory");
    const int ct = tid - 128, wg = ct / 128, q = (ct % 128) / WARP, g = lane / 4, t = lane % 4;
    const int row0 = wg * 64 + q * 16 + g;  // this thread's weight rows: row0 and row0 + 8 of the item's 128
    const u32 sel = 0x0400u + 0x0101u * (u32)t;  // byte t of a word: inputs 2t, 2t + 1
    const MoeDownRsConsumer c{smem, smem0, pairs0, staged0, full, empty, table_empty, row0, lane, ct, t, sel, out};
    int step = 0, n = 0;
#pragma unroll 1
    for (int item = blockIdx.x; item < items; item += gridDim.x, step += STEPS, n++) {
        // The item's table gives its rows, and so the width of its MMAs (the producer's is the same).
        mbarrier_wait(table_full + 8 * (n % 2), (n / 2) % 2);
        const unsigned char* table = smem + (table0 - smem0) + (n % 2) * MOE_DOWN_RS_TABLE;
        const int rows = *(const int*)(table + MOE_RS_TOKENS * 8);
        // Through a shuffle, so ptxas knows the width is warp-uniform.
        const int width = __shfl_sync(0xffffffffu, moe_rs_width(rows), 0);
        if (width == 16)
            c.item<16>(item, step, n, table, rows);
        else if (width == 32)
            c.item<32>(item, step, n, table, rows);
        else if (width == 64)
            c.item<64>(item, step, n, table, rows);
        else
            c.item<MOE_RS_TOKENS>(item, step, n, table, rows);
    }
#else
    wait_previous();
    __trap();  // built without wgmma: the host never launches it (moe_rs_down is 0)
#endif
}

// ---- The small tiling: few entries per expert, on the integer tensor cores ----
// A batched decode step or a short prompt routes a few tokens to each expert, so its grouped products stream each
// chosen expert's weights once for a handful of rows, and the time goes into the bytes and into turning 4-bit codes
// into tensor-core operands. Here the codes stay integers, as in the decode's matrix-vector products: a weight
// word's low nibbles (a mask) and high nibbles (a shift and a mask) are four u8 operands each of mma.m16n8k32,
// against activations given as two signed 8-bit digits per input (Q8x2 below), so the products' integer sums are
// exact and each group's (scale, bias) pair applies once per output: over a group, w . x = scale (s / 128)
// (128 C0 + C1) + bias sum(x), where C0 and C1 are the digits' integer sums and s the activations' scale.
//
// Roles: the weight rows are A (m16: 16 rows a fragment), the tokens B (n8: 4 tokens x 2 digits, column 2j + d
// is token j's digit d), so at a group's end lane (g, t) holds rows g and g + 8 of token t's two digit sums.
//
// `rows` rows of k inputs hi + lo (lo may be null; k whole groups) as Q8x2 rows (codes u32 [rows][k / 2], pairs
// float2 [rows][k / 64]); a thread a word, the block's threads from `first` on (a multiple of 8: whole groups).
__device__ __forceinline__ void quantize_rows_q8x2(int first, const bf16* hi, const bf16* lo, int rows, int k,
                                                   u32* codes, float* pairs) {
    const int words = k / 8;
    const int i = first + threadIdx.x;
    const bool valid = i < rows * words;
    const int r = valid ? i / words : 0, w = valid ? i % words : 0;
    const uint4 h = *(const uint4*)(hi + (size_t)r * k + 8 * w);
    const uint4 l = lo ? *(const uint4*)(lo + (size_t)r * k + 8 * w) : make_uint4(0u, 0u, 0u, 0u);
    float v[8];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const float2 a = pair_to_float2(word_of(h, j)), b = pair_to_float2(word_of(l, j));  // bf16 pairs
        v[2 * j] = a.x + b.x, v[2 * j + 1] = a.y + b.y;
    }
    quantize_word_q8x2(v, w % 8, valid, (uint4*)codes + (size_t)r * words + w,
                       (float2*)pairs + (size_t)r * (k / GROUP) + w / 8);
}

// The small tiling's input: `rows` rows of HIDDEN inputs hi + lo (lo may be null) as Q8x2 rows.
extern "C" __global__ void __launch_bounds__(256)
    moe_quantize_rows(const bf16* hi, const bf16* lo, int rows, Q8x2 out) {
    wait_previous();
    quantize_rows_q8x2(blockIdx.x * blockDim.x, hi, lo, rows, HIDDEN, out.codes, out.pairs);
}

// Tile and stages. A tile is up to SMALL_ROWS sorted entries of one expert; a work item (tile, column block) takes
// 256 weight rows (gate/up: 128 of gate and the same 128 of up; down: 256 of down). A stage is one piece of the
// tiled weights (two groups): the tile's activation codes (a token's 256 bytes, padded so the two tokens that a
// half-warp's B loads read lie in different banks), their pairs, the 256 rows' codes (64 bytes a row, its four
// 16-byte chunks swizzled by row so ldmatrix reads 8 rows without conflicts) and their two (scale, bias) pairs.
#ifndef MOE_SMALL_TILE_ROWS
#define MOE_SMALL_TILE_ROWS 16
#endif
#ifndef MOE_SMALL_STAGES
#define MOE_SMALL_STAGES 4
#endif
#ifndef MOE_SMALL_MIN_BLOCKS
#define MOE_SMALL_MIN_BLOCKS 2
#endif
constexpr int SMALL_ROWS = MOE_SMALL_TILE_ROWS;
constexpr int SMALL_NF = SMALL_ROWS / 4;  // n8 fragments of 4 tokens
constexpr int SMALL_A_ROW = 2 * Q8X2_GROUP_BYTES + 64;
// A block covers 128 F weight rows, each warp F m16 fragments: F = 2 for the experts' items and the dense products'
// wide blocks of 256 rows; F = 1 for the dense products' narrow blocks of 128 rows, of which more fit an SM. A tile
// holds ROWS activation rows (SMALL_ROWS for the experts; the dense products may take taller tiles, which read each
// weight from L2 once per ROWS rows). A stage holds the tile's codes and their pairs, then the weight rows' codes and
// their pairs; STAGES of them.
template <int F_, int STAGES_, int ROWS_ = SMALL_ROWS>
struct SmallTile {
    static constexpr int F = F_, STAGES = STAGES_, ROWS = ROWS_;
    static constexpr int NF = ROWS / 4;  // n8 fragments of 4 tokens
    static constexpr int A_BYTES = ROWS * SMALL_A_ROW, PAIR_BYTES = ROWS * 2 * 8;
    static constexpr int W_ROWS = TILED_ROWS * F;
    static constexpr int B_BYTES = W_ROWS * 64, SB_BYTES = W_ROWS * 8;
    static constexpr int STAGE = A_BYTES + PAIR_BYTES + B_BYTES + SB_BYTES;
    static constexpr int SMEM = STAGES * STAGE;
    static_assert(ROWS % 16 == 0 && ROWS <= 64, "whole half-warps of tokens per stage copy");
};
// Whether BLOCKS blocks of a kernel with SMEM bytes of dynamic shared memory fit an SM (228 KB, 1 KB of which the
// runtime reserves for each block).
__host__ __device__ constexpr bool fits_sm(int smem, int blocks) { return blocks * (smem + 1024) <= 228 * 1024; }
using SmallWide = SmallTile<2, MOE_SMALL_STAGES>;
constexpr int SMALL_SMEM = SmallWide::SMEM;
// The gate/up epilogue's SwiGLU tile (f32 [SMALL_ROWS][128], rows padded to 136 so a warp's stores, 4 tokens by 8
// columns, hit 32 banks) reuses the stages.
constexpr int SMALL_ACT_PITCH = 136;
static_assert(SMALL_ROWS % 16 == 0 && SMALL_ROWS <= 64, "whole half-warps of tokens per stage copy and epilogue");
static_assert(SMALL_ROWS * SMALL_ACT_PITCH * 4 <= SMALL_SMEM && MOE_SMALL_STAGES >= 2, "the SwiGLU tile fits");
static_assert(TILED_PIECE == 2 * GROUP && TILED_PIECE_WORDS == 16, "a stage is a piece: two groups, 64 bytes a row");

// Read by the host (src/kernels/gemm.rs): the small tiling's height, and the most tokens a routing takes it for
// (up to 16 entries an expert on average: about one tile each).
#ifndef MOE_SMALL_MAX_TOKENS
#define MOE_SMALL_MAX_TOKENS 512
#endif
__device__ int moe_small_tile_rows = SMALL_ROWS;
__device__ int moe_small_max_tokens = MOE_SMALL_MAX_TOKENS;

// The first word and pair of one of an item's two blocks of 128 weight rows, and 16 (or 0: a block past the
// matrix, zero-filled) bytes a copy.
struct SmallBlock {
    const u32* words;
    const u32* pairs;
    u32 bytes;
};

// The weight rows of a small-tiling item (256) or narrow block (128), piece by piece (a piece: 128 inputs, 16 words
// and 2 (scale, bias) pairs a row). `chunk` gives the source in the item's first piece of 16-byte chunk c (0 .. 3)
// of item row `row` and how many of its bytes to copy (16, or 0 to zero-fill); a chunk's next piece lies
// PIECE_WORDS words later. `pair_copy` gives this thread's share of the block's rows' pairs in the first piece (its
// source, bytes and offset in the stage's pairs, 8 bytes a row; false where the thread copies none); the next
// piece's lie PIECE_PAIRS words later, and `copy_pair` issues the copy; `copy_chunk` issues a chunk's.
// TiledRows: two blocks of 128 rows of a tiled matrix (the experts: a row's pairs of a piece lie beside the next
// row's, so a thread copies two rows' pairs at once).
// The experts' weights are read once a step, so their copies ask L2 to evict them first (see cp_async_16_once);
// MOE_SMALL_EVICT_FIRST=0 copies them as any other bytes.
#ifndef MOE_SMALL_EVICT_FIRST
#define MOE_SMALL_EVICT_FIRST 1
#endif
struct TiledRows {
    SmallBlock block[2];
    static constexpr int PIECE_WORDS = TILED_PIECE_STEP, PIECE_PAIRS = TILED_PAIR_STEP;
    __device__ __forceinline__ const u32* chunk(int row, int c, u32& bytes) const {
        const SmallBlock& b = block[row / TILED_ROWS];
        bytes = b.bytes;
        return b.words + (row % TILED_ROWS) * TILED_PIECE_WORDS + 4 * c;
    }
    __device__ __forceinline__ bool pair_copy(const u32*& src, u32& bytes, int& dst, int) const {
        if (threadIdx.x >= WROWS / 2) return false;
        const int row = 2 * threadIdx.x;
        const SmallBlock& b = block[row / TILED_ROWS];
        src = b.pairs + (row % TILED_ROWS) * TILED_PIECE_PAIRS, bytes = b.bytes, dst = row * 8;
        return true;
    }
    __device__ static __forceinline__ void copy_chunk(u32 dst, const u32* src, u32 bytes) {
        if (MOE_SMALL_EVICT_FIRST) cp_async_16_once(dst, src, bytes);
        else cp_async_16(dst, src, bytes);
    }
    __device__ static __forceinline__ void copy_pair(u32 dst, const u32* src, u32 bytes) { copy_chunk(dst, src, bytes); }
};

// DenseRows: 256 rows of a row-major matrix (MLX order: a row's words, then separately its pairs) whose first row's
// first word and pair of the item's first piece are `words` and `pairs`; `valid` of the rows lie in the matrix, the
// others are zero-filled.
struct DenseRows {
    const u32* words;
    const u32* pairs;
    int valid, row_words, row_pairs;
    static constexpr int PIECE_WORDS = TILED_PIECE_WORDS, PIECE_PAIRS = TILED_PIECE_PAIRS;
    __device__ __forceinline__ const u32* chunk(int row, int c, u32& bytes) const {
        const bool in = row < valid;
        bytes = in ? 16u : 0u;
        return words + (size_t)(in ? row : 0) * row_words + 4 * c;
    }
    __device__ __forceinline__ bool pair_copy(const u32*& src, u32& bytes, int& dst, int w_rows) const {
        const int row = threadIdx.x;  // a thread a row of the block's w_rows (at most GEMM_THREADS)
        if (row >= w_rows) return false;
        const bool in = row < valid;
        src = pairs + (size_t)(in ? row : 0) * row_pairs, bytes = in ? 8u : 0u, dst = row * 8;
        return true;
    }
    __device__ static __forceinline__ void copy_chunk(u32 dst, const u32* src, u32 bytes) { cp_async_16(dst, src, bytes); }
    __device__ static __forceinline__ void copy_pair(u32 dst, const u32* src, u32 bytes) {
        cp_async_ca<8>(dst, src, bytes);
    }
};

// acc[f][nf][h] = the item's products for weight row frag_row(f) + g + 8h and token 4 nf + t of the tile (lane
// (g, t)), over `pieces` pieces. FULL: the tile's `rows` are all Tile::ROWS, so every fragment is computed without a
// check between them (which lets the compiler interleave the fragments' loads, products and sums); otherwise the
// fragments past `rows` are skipped. a_row(r) is the Q8x2 row (of `codes` and `pairs`, rows of `row_k` inputs, both
// already at the item's first piece) of the tile's token r < rows; `w` gives the weight rows; warp w's two m16
// fragments start at rows 16 w and 128 + 16 w (GATE_UP: the same columns of gate and of up) or 32 w and 32 w + 16
// (Tile::F = 1: one fragment, at row 16 w).
// The weights never depend on what the activations wait for, so the prologue requests its stages' weights first,
// then calls before() (a dense product: wait_previous for the codes; a down item: its tile's gate/up items), and
// only then reads a_row and requests the activations: each item's first weights are on their way without waiting
// for the routing's entries or for other blocks.
template <class Tile, bool GATE_UP, bool FULL, class ARow, class WRows, class Before>
__device__ __forceinline__ void small_products(float (&acc)[Tile::F][Tile::NF][2], int rows, ARow a_row,
                                               const u32* codes, const float* pairs, int row_k, int pieces,
                                               const WRows& w, Before before) {
    extern __shared__ __align__(128) unsigned char smem[];
    if (dynamic_smem_bytes() < Tile::SMEM) __trap();  // the host's shared memory is not the kernel's
    constexpr int F = Tile::F, STAGES = Tile::STAGES, SMALL_STAGE = Tile::STAGE, SMALL_B_BYTES = Tile::B_BYTES;
    constexpr int ROWS = Tile::ROWS, NF = Tile::NF, A_BYTES = Tile::A_BYTES, AB_BYTES = A_BYTES + Tile::PAIR_BYTES;
    static_assert(F == 2 || !GATE_UP, "a gate/up item takes 128 rows of each matrix");
    const int PIECES = pieces, ROW_BYTES = row_k * 2, ROW_PAIRS = row_k / GROUP;
    const int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP, g = lane / 4, t = lane % 4;
    const u32 smem0 = smem_addr(smem);
#pragma unroll
    for (int f = 0; f < F; f++)
#pragma unroll
        for (int nf = 0; nf < NF; nf++) acc[f][nf][0] = acc[f][nf][1] = 0.f;

    // Copies of a stage: the tokens' codes, chunk c % 16 of token c / 16 for c = tid, tid + 256, ...; their pairs
    // (16 bytes a token, threads below ROWS); chunk tid % 4 of weight rows tid / 4 + 64 j (j < 2 F); the
    // weight rows' pairs. Each copy's source in the first piece, its byte count and its place in a stage are worked
    // out once here; a piece only moves the sources along.
    constexpr int A_COPIES = ROWS * 16 / GEMM_THREADS;
    static_assert(ROWS * 16 % GEMM_THREADS == 0, "whole rounds of the threads copy a stage's codes");
    const unsigned char* a_src[A_COPIES];
    u32 a_bytes[A_COPIES];
    const float* ap_src = nullptr;
    u32 ap_bytes = 0;
    const u32* b_src[2 * F];
    u32 b_bytes[2 * F];
#pragma unroll
    for (int j = 0; j < 2 * F; j++) b_src[j] = w.chunk(tid / 4 + 64 * j, tid % 4, b_bytes[j]);
    // Rows 64 apart share their swizzle, so chunk j lands 64 rows (4,096 bytes) after chunk 0.
    const u32 b_dst = (tid / 4) * 64 + (((tid % 4) ^ ((tid / 8) & 3)) << 4);
    const u32* wp_src = nullptr;
    u32 wp_bytes = 0;
    int wp_dst = 0;
    const bool wp_copies = w.pair_copy(wp_src, wp_bytes, wp_dst, Tile::W_ROWS);

    auto load_a = [&](int kt) {
        const u32 stage = smem0 + (kt % STAGES) * SMALL_STAGE;
#pragma unroll
        for (int i = 0; i < A_COPIES; i++) {
            const int c = tid + i * GEMM_THREADS;
            cp_async_16(stage + (c / 16) * SMALL_A_ROW + (c % 16) * 16, a_src[i] + kt * 2 * Q8X2_GROUP_BYTES,
                        a_bytes[i]);
        }
        if (tid < ROWS) cp_async_16(stage + A_BYTES + tid * 16, ap_src + 4 * kt, ap_bytes);
    };
    auto load_b = [&](int kt) {
        const u32 b_stage = smem0 + (kt % STAGES) * SMALL_STAGE + AB_BYTES;
#pragma unroll
        for (int j = 0; j < 2 * F; j++)
            WRows::copy_chunk(b_stage + b_dst + j * 64 * 64, b_src[j] + (size_t)kt * WRows::PIECE_WORDS, b_bytes[j]);
        if (wp_copies)
            WRows::copy_pair(b_stage + SMALL_B_BYTES + wp_dst, wp_src + (size_t)kt * WRows::PIECE_PAIRS, wp_bytes);
    };
    auto load = [&](int kt) {
        load_a(kt);
        load_b(kt);
    };

    int frag_row[F];
    frag_row[0] = GATE_UP || F == 1 ? 16 * warp : 32 * warp;
    if constexpr (F == 2) frag_row[1] = GATE_UP ? TILED_ROWS + 16 * warp : 32 * warp + 16;
    // ldmatrix.x4 of fragment f, group gi: lanes 8i .. 8i + 7 address matrix i, rows 8 (i % 2) .. + 7 of the
    // fragment at chunk 2 gi + i / 2 (the group's k32 step i / 2), so r[0], r[1] are step 0's words of rows g and
    // g + 8 and r[2], r[3] step 1's.
    u32 ld_off[F][2];
#pragma unroll
    for (int f = 0; f < F; f++)
#pragma unroll
        for (int gi = 0; gi < 2; gi++) {
            const int row = frag_row[f] + (lane & 7) + ((lane >> 3) & 1) * 8, chunk = 2 * gi + (lane >> 4);
            ld_off[f][gi] = AB_BYTES + row * 64 + ((chunk ^ ((row >> 1) & 3)) << 4);
        }
    constexpr u32 LOW = 0x0F0F0F0Fu;

    // The prologue's stages, each a cp.async group; the first group also holds every prologue stage's weights,
    // requested before `before` (the k loop's first wait covers all of them).
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++)
        if (s < PIECES) load_b(s);
    before();
#pragma unroll
    for (int i = 0; i < A_COPIES; i++) {
        const int c = tid + i * GEMM_THREADS, r = c / 16;
        a_src[i] = (const unsigned char*)codes + (size_t)a_row(r < rows ? r : 0) * ROW_BYTES + (c % 16) * 16;
        a_bytes[i] = r < rows ? 16u : 0u;
    }
    ap_src = pairs + (size_t)a_row(tid < rows ? tid : 0) * 2 * ROW_PAIRS;
    ap_bytes = tid < rows ? 16u : 0u;
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < PIECES) load_a(s);
        cp_async_commit();
    }
#pragma unroll 1
    for (int kt = 0; kt < PIECES; kt++) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();  // stage kt has landed for every thread; stage kt - 1's buffer is free again
        if (kt + STAGES - 1 < PIECES) load(kt + STAGES - 1);
        cp_async_commit();
        const int at = (kt % STAGES) * SMALL_STAGE;
        const u32* sb = (const u32*)(smem + at + AB_BYTES + SMALL_B_BYTES);
#pragma unroll
        for (int gi = 0; gi < 2; gi++) {
            u32 a[F][2][4];  // [fragment][k32 step]: A's four registers
            float2 wsb[F][2];  // [fragment][row g, g + 8]: (scale, bias)
#pragma unroll
            for (int f = 0; f < F; f++) {
                u32 w[4];
                ldmatrix_x4(w, smem0 + at + ld_off[f][gi]);
#pragma unroll
                for (int s = 0; s < 2; s++) {
                    a[f][s][0] = w[2 * s] & LOW, a[f][s][1] = w[2 * s + 1] & LOW;
                    a[f][s][2] = (w[2 * s] >> 4) & LOW, a[f][s][3] = (w[2 * s + 1] >> 4) & LOW;
                }
#pragma unroll
                for (int h = 0; h < 2; h++) wsb[f][h] = pair_to_float2(sb[(frag_row[f] + g + 8 * h) * 2 + gi]);
            }
#pragma unroll
            for (int nf = 0; nf < NF; nf++) {
                if (!FULL && nf * 4 >= rows) break;  // warp-uniform: the fragments past the tile's tokens
                // B: token 4 nf + g / 2's digit g % 2, words t (step 0) and 4 + t (step 1) of group gi.
                const unsigned char* bp = smem + at + (nf * 4 + g / 2) * SMALL_A_ROW + gi * Q8X2_GROUP_BYTES +
                                          t * Q8X2_WORD_BYTES + (g % 2) * 8;
                const uint2 b0 = *(const uint2*)bp, b1 = *(const uint2*)(bp + 4 * Q8X2_WORD_BYTES);
                const float2 xp = *(const float2*)(smem + at + A_BYTES + (nf * 4 + t) * 16 + gi * 8);
#pragma unroll
                for (int f = 0; f < F; f++) {
                    int c[4] = {0, 0, 0, 0};
                    mma_u4s8(c, a[f][0][0], a[f][0][1], a[f][0][2], a[f][0][3], b0.x, b0.y);
                    mma_u4s8(c, a[f][1][0], a[f][1][1], a[f][1][2], a[f][1][3], b1.x, b1.y);
#pragma unroll
                    for (int h = 0; h < 2; h++)
                        acc[f][nf][h] = fmaf(wsb[f][h].x * xp.x, (float)(c[2 * h] * 128 + c[2 * h + 1]),
                                             fmaf(wsb[f][h].y, xp.y, acc[f][nf][h]));
                }
            }
        }
    }
    cp_async_wait<0>();
    __syncthreads();  // every warp is done with the stages (the gate/up epilogue reuses them)
}

// Expert e's block of 128 rows `row0` .. of a stacked tiled matrix (the shared expert's matrix for e = NUM_EXPERTS),
// zero-filled past `rows`.
__device__ __forceinline__ SmallBlock small_block(Q4 experts, Q4 shared, int e, int rows, int row0, int k) {
    const WeightRow w = expert_row(experts, shared, e, rows, row0, row0 < rows, k);
    return SmallBlock{w.packed, w.scale_bias, w.bytes};
}

// act (Q8x2, by sorted index i) = silu(gate_e x[token]) * (up_e x[token]) for the entries of tile `tile`, output
// columns 128 cb ..: the products, the SwiGLU into shared memory, then each (token, group of 64 columns) quantized
// by 8 lanes.
__device__ __noinline__ void moe_small_gate_up(int tile, int cb, const u32* x_codes, const float* x_pairs,
                                               const int* entries, const int* tiles, const int* offsets, Q4 gate,
                                               Q4 up, Q4 shared_gate, Q4 shared_up, u32* act_codes,
                                               float* act_pairs) {
    extern __shared__ __align__(128) unsigned char smem[];
    const int expert = tiles[2 * tile], first = tiles[2 * tile + 1];
    const int rows = min(SMALL_ROWS, offsets[expert + 1] - first), n0 = cb * TILED_ROWS;
    const TiledRows w = {{small_block(gate, shared_gate, expert, MOE_INTER, n0, HIDDEN),
                          small_block(up, shared_up, expert, MOE_INTER, n0, HIDDEN)}};
    float acc[2][SMALL_NF][2];
    small_products<SmallWide, true, false>(acc, rows, [&](int r) { return entries[first + r] / MOE_SLOTS; }, x_codes,
                                           x_pairs, HIDDEN, HIDDEN / TILED_PIECE, w, [] {});
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, g = lane / 4, t = lane % 4;
    float* act = (float*)smem;
#pragma unroll
    for (int nf = 0; nf < SMALL_NF; nf++)
#pragma unroll
        for (int h = 0; h < 2; h++)
            act[(nf * 4 + t) * SMALL_ACT_PITCH + 16 * warp + g + 8 * h] = siluf_(acc[0][nf][h]) * acc[1][nf][h];
    __syncthreads();
    // Thread u: token u / 16, the item's group (u / 8) % 2, word u % 8.
#pragma unroll
    for (int u = threadIdx.x; u < SMALL_ROWS * 16; u += GEMM_THREADS) {
        const int r = u / 16, group = (u / 8) % 2, word = u % 8;
        const float4 lo = *(const float4*)(act + r * SMALL_ACT_PITCH + group * GROUP + word * 8);
        const float4 hi = *(const float4*)(act + r * SMALL_ACT_PITCH + group * GROUP + word * 8 + 4);
        const float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
        const size_t row = (size_t)(first + (r < rows ? r : 0));
        const int col_group = n0 / GROUP + group;
        quantize_word_q8x2(v, word, r < rows,
                           (uint4*)act_codes + row * (MOE_INTER / 8) + col_group * 8 + word,
                           (float2*)act_pairs + row * (MOE_INTER / GROUP) + col_group);
    }
}

__device__ __forceinline__ int load_acquire(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// out[entries[i]][:] = route_w[entries[i]] * (down_e act[i]) for the sorted indices i of tile `tile`, output columns
// 256 cb ..., once the tile's gate/up items are done (`done`, their count, reaches MOE_GATE_UP_COLS): each of those
// was taken before this item by a block that is running, so the wait ends. The first pieces' weights are requested
// before the wait.
__device__ __noinline__ void moe_small_down(int tile, int cb, const u32* act_codes, const float* act_pairs,
                                            const int* entries, const int* tiles, const int* offsets,
                                            const float* route_w, Q4 down, Q4 shared_down, bf16* out,
                                            const int* done) {
    const int expert = tiles[2 * tile], first = tiles[2 * tile + 1];
    const int rows = min(SMALL_ROWS, offsets[expert + 1] - first), n0 = cb * WROWS;
    const TiledRows w = {{small_block(down, shared_down, expert, HIDDEN, n0, MOE_INTER),
                          small_block(down, shared_down, expert, HIDDEN, n0 + TILED_ROWS, MOE_INTER)}};
    float acc[2][SMALL_NF][2];
    small_products<SmallWide, false, false>(acc, rows, [&](int r) { return first + r; }, act_codes, act_pairs,
                                            MOE_INTER, MOE_INTER / TILED_PIECE, w, [&] {
                                                if (threadIdx.x == 0)
                                                    while (load_acquire(done) < MOE_GATE_UP_COLS) __nanosleep(64);
                                                __syncthreads();  // the tile's codes are read with cp.async.cg, from L2
                                            });
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, g = lane / 4, t = lane % 4;
#pragma unroll
    for (int nf = 0; nf < SMALL_NF; nf++) {
        const int r = nf * 4 + t;
        if (r >= rows) continue;
        const int entry = entries[first + r];
        const float weight = route_w[entry];
#pragma unroll
        for (int f = 0; f < 2; f++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int col = n0 + 32 * warp + 16 * f + g + 8 * h;
                if (col < HIDDEN) out[(size_t)entry * HIDDEN + col] = float_to_bf16(weight * acc[f][nf][h]);
            }
    }
}

// The small tiling's gate/up and down in one persistent launch of a few blocks an SM. A block takes work items in
// the order of a counter (work[0]): first the gate/up items (tile, column block), tile-major, then the down items
// alike. A down item waits until its tile's gate/up items are done (work[1 + tile] counts them; see moe_small_down),
// and down items fill the SMs where the last gate/up items leave them idle. A block takes its next item from the
// counter as it starts the current one, so the counter's round trip is hidden behind the item's work. No wait can
// last forever: the lowest-numbered item taken and not done is always some block's current item (a block's next
// item comes after its current one), and every item it may wait for comes before it, so is done
// (MOE_SMALL_AHEAD=0 takes the next item after the current one). The host zeroes `work` (1 + tiles ints) before the
// launch.
#ifndef MOE_SMALL_AHEAD
#define MOE_SMALL_AHEAD 1
#endif
__device__ int moe_small_smem = SMALL_SMEM;
__device__ int moe_small_blocks_per_sm = MOE_SMALL_MIN_BLOCKS;
__device__ int moe_small_items_per_tile = MOE_GATE_UP_COLS + MOE_DOWN_COLS;

extern "C" __global__ void __launch_bounds__(GEMM_THREADS, MOE_SMALL_MIN_BLOCKS)
    moe_small(Q8x2 x, const int* entries, const int* tiles, const int* tile_count, const int* offsets,
              const float* route_w, Q4 gate, Q4 up, Q4 down, Q4 shared_gate, Q4 shared_up, Q4 shared_down, Q8x2 act,
              bf16* out, int* work) {
    __shared__ int taken;
    wait_previous();  // the tiles and the weights they pick come from the routing
    const int n_tiles = *tile_count;
    const int gate_up_items = n_tiles * MOE_GATE_UP_COLS, items = gate_up_items + n_tiles * MOE_DOWN_COLS;
    int* done = work + 1;
    if (threadIdx.x == 0) taken = atomicAdd(work, 1);
    __syncthreads();
    for (;;) {
        const int item = taken;
        if (item >= items) return;
        // Thread 0 takes the next item now and publishes it after this one (the atomic's result is not read before).
        int next = items;
        if (MOE_SMALL_AHEAD && threadIdx.x == 0) next = atomicAdd(work, 1);
        if (item < gate_up_items) {
            const int tile = item / MOE_GATE_UP_COLS;
            moe_small_gate_up(tile, item % MOE_GATE_UP_COLS, x.codes, x.pairs, entries, tiles, offsets, gate, up,
                              shared_gate, shared_up, act.codes, act.pairs);
            // Every thread's codes are visible on the GPU before the tile's count says so.
            __threadfence();
            __syncthreads();
            if (threadIdx.x == 0) atomicAdd(&done[tile], 1);
        } else {
            const int down_item = item - gate_up_items, tile = down_item / MOE_DOWN_COLS;
            moe_small_down(tile, down_item % MOE_DOWN_COLS, act.codes, act.pairs, entries, tiles, offsets, route_w,
                           down, shared_down, out, &done[tile]);
        }
        __syncthreads();  // the item's shared memory and `taken` are free for the next one
        if (threadIdx.x == 0) taken = MOE_SMALL_AHEAD ? next : atomicAdd(work, 1);
        __syncthreads();
    }
}

// ---- Dense products of few rows on the integer tensor cores ----
// A batched decode step's projections (and a short prompt's) have few activation rows, so, as for the experts, the
// time goes into streaming the 4-bit codes and turning them into operands; the small tiling's products serve them
// too: the activations quantized once to Q8x2 rows (into the module's own buffer below, by gemm_quantize_rows or by
// the rmsnorm_rows that produced them), then a block per (256 weight rows, or 128 in the narrow blocks below; a
// tile of activation rows; part of k) reads the row-major codes piece by piece (DenseRows). Few blocks (few
// rows, or few weight rows as in the output projections) cut k into gridDim.z parts of whole pieces; each part's
// tile goes to the split products' slots, and gemm_split_sum adds the parts in order.
// One part writes (or adds to) `out` itself. The products are exact integer sums of exact weights and activations
// to two 8-bit digits (as the experts'), so they are at least as close to the f32 product as the bf16 path.
#ifndef GEMM_SMALL_MAX_ROWS
#define GEMM_SMALL_MAX_ROWS 64
#endif
#ifndef GEMM_SMALL_MIN_PIECES
#define GEMM_SMALL_MIN_PIECES 2
#endif
#define GEMM_SMALL_ROWS_CAP 512  // rows the codes buffer holds: the most GEMM_SMALL_MAX_ROWS may be
#define GEMM_SMALL_MAX_K 4096
static_assert(GEMM_SMALL_MAX_ROWS <= GEMM_SMALL_ROWS_CAP, "the codes hold the rows");
// Read by the host (src/gemm.rs): the most rows the plan gives these products, the most the buffer holds (the
// self-test checks up to it), the widest k, and the fewest pieces of k a part takes.
__device__ int gemm_small_max_rows = GEMM_SMALL_MAX_ROWS;
__device__ int gemm_small_rows_cap = GEMM_SMALL_ROWS_CAP;
__device__ int gemm_small_max_k = GEMM_SMALL_MAX_K;
__device__ int gemm_small_min_pieces = GEMM_SMALL_MIN_PIECES;
__device__ __align__(16) u32 gemm_small_codes[(size_t)GEMM_SMALL_ROWS_CAP * GEMM_SMALL_MAX_K / 2];
__device__ __align__(16) float gemm_small_pairs[(size_t)GEMM_SMALL_ROWS_CAP * GEMM_SMALL_MAX_K / GROUP * 2];

// The codes of gemm_q4_small's input: m rows of k inputs (whole pieces, at most GEMM_SMALL_MAX_K; m at most
// GEMM_SMALL_ROWS_CAP), a thread a word.
extern "C" __global__ void __launch_bounds__(256) gemm_quantize_rows(const bf16* a, int m, int k) {
    wait_previous();
    quantize_rows_q8x2(blockIdx.x * blockDim.x, a, nullptr, m, k, gemm_small_codes, gemm_small_pairs);
}

// GEMM_SMALL_FULL=0 takes every tile with the checks between fragments (the experts' path).
#ifndef GEMM_SMALL_FULL
#define GEMM_SMALL_FULL 1
#endif

// out[m][n] = a[m][k] w[n][k]^T (+= where `accumulate` is 1) for the rows gemm_quantize_rows coded, 4-bit weights;
// block (Tile::W_ROWS weight rows, Tile::ROWS rows of a, part of k). A part's tile goes to the split products'
// slots, which are numbered by blocks of WROWS weight rows whatever the block's width. A tile whose rows are all
// valid (every tile but a product's last) takes the products without checks between the fragments.
template <class Tile>
__device__ __forceinline__ void gemm_q4_small_tile(int m, Q4 w, int n, int k, float* out, int accumulate) {
    constexpr int F = Tile::F, ROWS = Tile::ROWS;
    static_assert(SPLIT_ROWS % ROWS == 0, "a tile of rows lies in one of the split products' row blocks");
    const int m0 = blockIdx.y * ROWS, n0 = blockIdx.x * Tile::W_ROWS, rows = min(ROWS, m - m0);
    const int pieces = k / TILED_PIECE, parts = gridDim.z;
    const int p0 = blockIdx.z * pieces / parts, p1 = (blockIdx.z + 1) * pieces / parts;
    const DenseRows src = {w.packed + (size_t)n0 * (k / 8) + p0 * TILED_PIECE_WORDS,
                           w.scale_bias + (size_t)n0 * (k / GROUP) + p0 * TILED_PIECE_PAIRS,
                           min(Tile::W_ROWS, n - n0), k / 8, k / GROUP};
    float acc[F][Tile::NF][2];
    // (small_products waits for gemm_quantize_rows's codes after requesting the first pieces' weights.)
    const auto a_row = [&](int r) { return m0 + r; };
    const u32* codes = gemm_small_codes + p0 * 2 * Q8X2_GROUP_BYTES / 4;
    const float* pairs = gemm_small_pairs + p0 * 2 * TILED_PIECE_PAIRS;
    const auto before = [] { wait_previous(); };
    if (GEMM_SMALL_FULL && rows == ROWS)
        small_products<Tile, false, true>(acc, rows, a_row, codes, pairs, k, p1 - p0, src, before);
    else
        small_products<Tile, false, false>(acc, rows, a_row, codes, pairs, k, p1 - p0, src, before);
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, g = lane / 4, t = lane % 4;
    const int col_blocks = (n + WROWS - 1) / WROWS, tiles = col_blocks * ((m + SPLIT_ROWS - 1) / SPLIT_ROWS);
#pragma unroll
    for (int nf = 0; nf < Tile::NF; nf++) {
        const int r = m0 + nf * 4 + t;
        if (r >= m0 + rows) continue;
        float* slot = partial_slot(n0 / WROWS + col_blocks * (r / SPLIT_ROWS), blockIdx.z, tiles) +
                      (r % SPLIT_ROWS) * WROWS + n0 % WROWS;
#pragma unroll
        for (int f = 0; f < F; f++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int c = 16 * F * warp + 16 * f + g + 8 * h;
                if (parts > 1) {
                    slot[c] = acc[f][nf][h];
                } else if (n0 + c < n) {
                    float* o = out + (size_t)r * n + n0 + c;
                    *o = accumulate ? *o + acc[f][nf][h] : acc[f][nf][h];
                }
            }
    }
}

// The dense products' wide blocks: their shared memory and blocks an SM (read by the host, src/gemm.rs).
#define GEMM_SMALL_WIDE_BLOCKS 2
static_assert(fits_sm(SmallWide::SMEM, GEMM_SMALL_WIDE_BLOCKS), "the wide blocks fit an SM");
__device__ int gemm_small_smem = SmallWide::SMEM;
__device__ int gemm_small_blocks_per_sm = GEMM_SMALL_WIDE_BLOCKS;

extern "C" __global__ void __launch_bounds__(GEMM_THREADS, GEMM_SMALL_WIDE_BLOCKS)
    gemm_q4_small(int m, Q4 w, int n, int k, float* out, int accumulate) {
    gemm_q4_small_tile<SmallWide>(m, w, n, k, out, accumulate);
}

// The narrow blocks: 128 weight rows, a fragment a warp, so a block needs half the shared memory and registers and
// GEMM_SMALL_NARROW_BLOCKS of them share an SM. Where a product's wide blocks leave SMs idle or few warps on each
// (a batched step's projections), twice as many narrow ones keep more warps in flight to hide the loads' and the
// integer products' latency, at the cost of reading the activation codes once per 128 weight rows, not 256.
#ifndef GEMM_SMALL_NARROW
#define GEMM_SMALL_NARROW 1
#endif
#ifndef GEMM_SMALL_NARROW_STAGES
#define GEMM_SMALL_NARROW_STAGES 4
#endif
#ifndef GEMM_SMALL_NARROW_BLOCKS
#define GEMM_SMALL_NARROW_BLOCKS 3
#endif
using SmallNarrow = SmallTile<1, GEMM_SMALL_NARROW_STAGES>;
static_assert(fits_sm(SmallNarrow::SMEM, GEMM_SMALL_NARROW_BLOCKS), "the narrow blocks fit an SM");
// Read by the host (src/gemm.rs): whether the plan takes the narrow blocks, their shared memory and blocks an SM.
__device__ int gemm_small_narrow = GEMM_SMALL_NARROW;
__device__ int gemm_small_narrow_smem = SmallNarrow::SMEM;
__device__ int gemm_small_narrow_blocks_per_sm = GEMM_SMALL_NARROW_BLOCKS;

extern "C" __global__ void __launch_bounds__(GEMM_THREADS, GEMM_SMALL_NARROW_BLOCKS)
    gemm_q4_small_narrow(int m, Q4 w, int n, int k, float* out, int accumulate) {
    gemm_q4_small_tile<SmallNarrow>(m, w, n, k, out, accumulate);
}

// The tall narrow blocks: the narrow blocks' 128 weight rows for tiles of GEMM_SMALL_TALL_ROWS activation rows, which
// the narrow blocks take where a product has more rows than one short tile (GEMM_SMALL_TALL=0: never). Each weight
// is read from L2 once per tile, so half as often for the batched step's 64 rows; the longer tile's registers and
// stages leave room for two blocks an SM.
#ifndef GEMM_SMALL_TALL
#define GEMM_SMALL_TALL 1
#endif
#ifndef GEMM_SMALL_TALL_ROWS
#define GEMM_SMALL_TALL_ROWS 32
#endif
#ifndef GEMM_SMALL_TALL_STAGES
#define GEMM_SMALL_TALL_STAGES 3
#endif
#ifndef GEMM_SMALL_TALL_BLOCKS
#define GEMM_SMALL_TALL_BLOCKS 2
#endif
using SmallTall = SmallTile<1, GEMM_SMALL_TALL_STAGES, GEMM_SMALL_TALL_ROWS>;
static_assert(fits_sm(SmallTall::SMEM, GEMM_SMALL_TALL_BLOCKS), "the tall blocks fit an SM");
// Read by the host (src/gemm.rs): whether the narrow blocks take tall tiles, their height, shared memory and blocks
// an SM.
__device__ int gemm_small_tall = GEMM_SMALL_TALL;
__device__ int gemm_small_tall_rows = GEMM_SMALL_TALL_ROWS;
__device__ int gemm_small_tall_smem = SmallTall::SMEM;
__device__ int gemm_small_tall_blocks_per_sm = GEMM_SMALL_TALL_BLOCKS;

extern "C" __global__ void __launch_bounds__(GEMM_THREADS, GEMM_SMALL_TALL_BLOCKS)
    gemm_q4_small_tall(int m, Q4 w, int n, int k, float* out, int accumulate) {
    gemm_q4_small_tile<SmallTall>(m, w, n, k, out, accumulate);
}
