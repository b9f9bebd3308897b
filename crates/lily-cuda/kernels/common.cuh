// Shared by every kernel file (prepended to each at compile time). The model's dimensions arrive as -D defines
// from the Config (see src/kernels/mod.rs), so the tiny and the full model run the same code.
//
// Quantized matrices: MLX's packed 4-bit (or 8-bit) rows, `cols * bits / 32` u32 words a row, low bits first;
// beside them one bf16x2 (scale, bias) per group of 64 inputs, `[rows][cols / 64]` (repacked from MLX's two
// arrays so one 4-byte load gives both).

typedef unsigned int u32;
typedef unsigned long long u64;
typedef signed char i8;
typedef unsigned char u8;
// bf16 as raw bits: NVRTC's own headers are all the kernels rely on, so CI compiles them with NVRTC alone.
typedef unsigned short bf16;
#define INF_F __int_as_float(0x7f800000)
#define NAN_F __int_as_float(0x7fc00000)

__device__ __forceinline__ float bf16_to_float(bf16 h) { return __uint_as_float((u32)h << 16); }
// Round to nearest even, as half::bf16::from_f32.
__device__ __forceinline__ bf16 float_to_bf16(float f) {
    const u32 b = __float_as_uint(f);
    if ((b & 0x7fffffffu) > 0x7f800000u) return (bf16)((b >> 16) | 0x40u);
    return (bf16)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}
// IEEE binary16 as raw bits: the storage of the DeltaNet recurrent state, which is computed in f32. Stored in half,
// whose 11 significant bits keep a long generation's logits close to an f32 state's (bf16's 8 do not: the state's
// rounding errors accumulate over the steps; bench/RESULTS.md has the measurement), the state costs half the memory
// and half the traffic of the batched step. An entry beyond half's range is saturated to the largest finite value
// rather than becoming infinite; NaN stays NaN.
typedef unsigned short f16;
__device__ __forceinline__ float f16_to_float(f16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ f16 float_to_f16(float f) {
    f16 h;
    asm("cvt.rn.satfinite.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
// Two adjacent state entries: (lo, hi) from and to one 32-bit word, lo at the lower address.
__device__ __forceinline__ float2 f16x2_to_float2(u32 w) { return make_float2(f16_to_float((f16)w), f16_to_float((f16)(w >> 16))); }
__device__ __forceinline__ u32 float2_to_f16x2(float lo, float hi) { return (u32)float_to_f16(lo) | (u32)float_to_f16(hi) << 16; }

// A (scale, bias) pair: scale in the low half (the lower address), bias in the high half.
__device__ __forceinline__ float2 pair_to_float2(u32 p) {
    return make_float2(__uint_as_float(p << 16), __uint_as_float(p & 0xffff0000u));
}

#define GROUP 64
#define WARP 32

// d += a b for a 16x16 bf16 A fragment and a 16x8 bf16 B fragment (b0, b1), f32 accumulators (mma.sync m16n8k16).
__device__ __forceinline__ void mma_bf16(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// bf16x2 of (lo, hi), each rounded to nearest even; lo in the low half (the lower address / column).
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

__device__ __forceinline__ u32 word_of(const uint4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

// A token's expert slots: its TOP_K routed experts, then the shared expert, which every product takes as one more
// expert of the same width (number NUM_EXPERTS in the grouped products' sort), weighted by its sigmoid gate.
#define MOE_SLOTS (TOP_K + 1)
static_assert(SHARED_INTER == MOE_INTER, "the shared expert is one more expert of the routed experts' width");

// The attention KV lives in pages of KV_PAGE positions from one pool per layer (bf16 [page][KV_PAGE][KV_DIM]); a
// sequence's page-table row maps its position p to page pages[p / KV_PAGE], row p % KV_PAGE of that page.
#define KV_PAGE 64
__device__ __forceinline__ size_t kv_offset(const int* pages, int position) {
    return ((size_t)pages[position / KV_PAGE] * KV_PAGE + position % KV_PAGE) * KV_DIM;
}

// cp.async groups: close this thread's copies issued since the last commit as a group; wait until at most
// PENDING of its newest groups are still in flight.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(PENDING) : "memory");
}
// Copies `bytes` (16 or 0) of the 16 at `src` to shared address `dst` (cp.async, through L2 only), zero-filling
// the rest.
__device__ __forceinline__ void cp_async_16(u32 dst, const void* src, u32 bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}
// Four 8 x 8 matrices of 16-bit elements from shared memory (lane L gives the address of row L % 8 of matrix L / 8,
// 16 contiguous bytes); register i of lane L holds the 32-bit word L % 4 of row L / 4 of matrix i, or with `trans`
// of the transposed matrix. The word view also serves 32-bit (tf32) fragments: row L / 4, word L % 4.
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
// The same for bytes a kernel reads once (the experts' weights in a batched step): L2 is asked to evict them before
// other lines, so they pass through without pushing out what the step reads again soon (the dense products' weights,
// which each row tile reads, and the activations).
__device__ __forceinline__ void cp_async_16_once(u32 dst, const void* src, u32 bytes) {
    asm volatile(
        "{\n\t.reg .b64 policy;\n\tcreatepolicy.fractional.L2::evict_first.b64 policy, 1.0;\n\t"
        "cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, policy;\n\t}" ::"r"(dst),
        "l"(src), "r"(bytes)
        : "memory");
}

struct Q4 {
    const u32* packed;
    const u32* scale_bias;
};

// A tensor map (the driver's CUtensorMap: 128 opaque bytes, 64-byte aligned) that the host encodes for the tensor
// memory accelerator (TMA, Hopper on). A kernel takes it as a `const __grid_constant__` parameter, whose address the
// bulk tensor copies name.
struct __align__(64) TmaMap {
    u64 words[16];
};

// The expert matrices (routed and shared, 4-bit) are tiled: their rows in blocks of TILED_ROWS, and a block's
// words ordered by pieces of TILED_PIECE inputs (16 packed words and 2 (scale, bias) pairs a row), row after row
// within a piece. A block spans the words its rows span row by row, so an expert's rows start where they would;
// what the tiling changes is that one piece of a block's rows, what a grouped product's stage or a decode strip
// reads, is one contiguous run (8 KB of codes) instead of 64 bytes from each row. src/weights.rs tiles them at load.
#define TILED_ROWS 128
#define TILED_PIECE 128
#define TILED_PIECE_WORDS (TILED_PIECE / 8)
#define TILED_PIECE_PAIRS (TILED_PIECE / GROUP)
// The first packed word of row `row` of a tiled matrix of `cols` inputs, and its first (scale, bias) pair; piece j
// of the row starts j * TILED_PIECE_STEP words (TILED_PAIR_STEP pairs) later.
#define TILED_PIECE_STEP (TILED_ROWS * TILED_PIECE_WORDS)
#define TILED_PAIR_STEP (TILED_ROWS * TILED_PIECE_PAIRS)
__device__ __forceinline__ const u32* tiled_row(Q4 m, int row, int cols) {
    return m.packed + (size_t)(row / TILED_ROWS) * TILED_ROWS * (cols / 8) + (row % TILED_ROWS) * TILED_PIECE_WORDS;
}
__device__ __forceinline__ const u32* tiled_row_pairs(Q4 m, int row, int cols) {
    return m.scale_bias + (size_t)(row / TILED_ROWS) * TILED_ROWS * (cols / GROUP) +
           (row % TILED_ROWS) * TILED_PIECE_PAIRS;
}

__device__ __forceinline__ uint4 load_stream(const u32* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block; every thread gets the result. `scratch` holds 32 floats.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, warps = (blockDim.x + WARP - 1) / WARP;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float total = 0.f;
    for (int w = 0; w < warps; w++) total += scratch[w];
    return total;
}

__device__ __forceinline__ float sigmoidf_(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float siluf_(float x) { return x / (1.f + expf(-x)); }
__device__ __forceinline__ float softplusf_(float x) { return x > 20.f ? x : log1pf(expf(x)); }

// Whether value va at index a ranks before value vb at index b: the larger value first, the lower index among
// equal values. Every choice of the largest (greedy tokens, top-k experts, top-k candidates) uses this one order.
// A macro, so each use compiles exactly as the expression written out; `ranks_before` is the same order as a
// function, for rank counting over arrays.
#define RANKS_BEFORE(va, a, vb, b) ((va) > (vb) || ((va) == (vb) && (a) < (b)))
__device__ __forceinline__ bool ranks_before(float va, int a, float vb, int b) { return RANKS_BEFORE(va, a, vb, b); }
// A value as those choices rank it: a NaN as negative infinity. A NaN compares false with everything, so it would
// never be chosen, and a row of NaNs would leave a choice at its starting index (past the end); ranked as negative
// infinity, every value has a place in the order and a row of NaNs chooses its lowest index, as the CPU twins do.
__device__ __forceinline__ float rank_value(float v) { return isnan(v) ? -INF_F : v; }

// 2^23 + q as a float's bits, minus 2^23: a 4-bit integer to float in two integer/float ops, no conversion unit.
__device__ __forceinline__ float nibble_to_float(u32 word, int shift) {
    return __uint_as_float(0x4B000000u | ((word >> shift) & 0xFu)) - 8388608.f;
}

#ifdef LILY_TIMELINE
// `lily bench --timeline`: the first thread of each kernel takes the next slot before its wait (kernels start in
// launch order, so slots follow it) and writes the global clock (ns) there when the wait returns, with the launch's
// grid id. A kernel that waits more than once (a persistent product waits before each item) takes a slot each
// time; the host keeps each launch's first.
#define TIMELINE_SLOTS (1 << 16)
struct Timeline {
    u32 next;
    u32 unused;
    u64 at[TIMELINE_SLOTS];
    u64 grid[TIMELINE_SLOTS];
};
__device__ Timeline* timeline;  // set by the host in every module
#endif

// Programmatic dependent launch (every kernel is launched with it from Hopper on, and every kernel calls this
// before it reads its predecessor's results or writes anything): a kernel requests what does not depend on its
// predecessor (its weights, its own state), calls this to wait for the predecessor's results, and only then lets
// the next kernel start. So one kernel at a time prefetches while another computes; were the next
// kernel let start at once, the whole step's weight requests would queue ahead of the loads each kernel waits on.
// Before Hopper there is no dependent launch (the host launches plainly there), and the wait is a no-op.
__device__ __forceinline__ void wait_previous() {
#ifdef LILY_TIMELINE
    const bool first = threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0 && timeline;
    const u32 slot = first ? atomicAdd(&timeline->next, 1u) : TIMELINE_SLOTS;
#endif
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
#ifdef LILY_TIMELINE
    if (slot < TIMELINE_SLOTS) {
        u64 now;
        u64 grid;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        asm("mov.u64 %0, %%gridid;" : "=l"(grid));
        timeline->at[slot] = now;
        timeline->grid[slot] = grid;
    }
#endif
}

// ---- 4-bit matrix-vector products on the tensor cores (the decode step's weights) ----
// Decode uses each weight once, so a product costs what turning a weight into a multiplication costs. Here a
// word of 8 weights becomes two registers of 4 bytes (a mask; a shift and a mask), and integer mma.sync
// (m16n8k32, u8 x s8, s32 accumulation) multiplies 16 rows by 32 inputs at once: under one instruction a weight,
// against three (shift, lop3, FMA) on the FMA pipe. The input is staged once per block as three signed bytes an
// element, x = (p0 + p1 / 128 + p2 / 128^2) * max / 127 per group of 64 (about 21 significant bits), and the sums
// over a group are exact integers, so the products are as precise as f32 ones. The group's scale and bias are
// applied to the mma's result, the bias through the group's f32 sum of x.
//
// Fragments (lane = 4 g + t): a warp takes a strip of 16 rows; a tile is 128 inputs (two groups). Lane t loads
// 16 bytes (32 inputs) of rows g and g + 8 at input 32 t of the tile; word m gives A's registers for one mma: its
// even nibbles (inputs 8m + 0, 2, 4, 6) and its odd ones (8m + 1, 3, 5, 7), so the mma sees the inputs permuted,
// and the staged x follows the same order. B's column n = 2 part + group holds that part of that group's x
// (columns 6 and 7 are zero), so lane t < 3 ends with part t of rows g and g + 8, both groups, in C.
#define MV_TILE 128
#define MV_PARTS 3

// The staged input: `x8` [part][tile][lane t][word m] uint2 (B's two registers), then a zero block; `gc`
// [part + 1][tile] float4 {x scale of group 1, of group 2, sum(x) of group 1, of group 2}: the scale is
// max / 127 / 128^part, the sums only in part 0, and the last row all zero (lanes t = 3 hold no part).
template <int COLS>
struct StagedX {
    static constexpr int TILES = COLS / MV_TILE;
    uint4 x8[MV_PARTS * TILES * 4 * 2 + 2];
    float4 gc[(MV_PARTS + 1) * TILES];
};

__device__ __forceinline__ u32 byte_of(float v, int at) { return ((u32)(int)v & 0xffu) << (8 * at); }

// What a matrix-vector product's input is made of. For element k, `fetch_early(k)` loads what does not depend
// on the previous kernel (a norm's weights; requested before the wait), `fetch(k)` what does, and `element`
// gives the element and what it adds to a norm's sum of squares (the norms' scalars are applied after the
// products: W (a x) = a (W x)).
struct Nothing {};
struct PlainInput {
    const float* x;
    typedef Nothing Early;
    typedef float Raw;
    __device__ __forceinline__ Early fetch_early(int) const { return Nothing{}; }
    __device__ __forceinline__ Raw fetch(int k) const { return x[k]; }
    __device__ __forceinline__ float2 element(Raw v, Early) const { return make_float2(v, 0.f); }
};
// hidden * norm, hidden^2: an RMSNorm's input before its 1 / rms (`rms_inv` of the block's sum).
struct NormedInput {
    const float* hidden;
    const float* norm;
    typedef float Early;
    typedef float Raw;
    __device__ __forceinline__ Early fetch_early(int k) const { return norm[k]; }
    __device__ __forceinline__ Raw fetch(int k) const { return hidden[k]; }
    __device__ __forceinline__ float2 element(Raw h, Early w) const { return make_float2(h * w, h * h); }
};
__device__ __forceinline__ float rms_inv(float sum_sq, int n) { return 1.f / sqrtf(sum_sq / n + RMS_EPS); }
// A scale applied to a whole tile from its sum of squares (a per-head norm over the tile's 128 inputs), or none.
struct NoTileScale {
    __device__ __forceinline__ float operator()(float) const { return 1.f; }
};

// Lane's inputs of tile j: elements k0 + 2i, i < 4 (a half-warp per group; lanes follow B's layout).
__device__ __forceinline__ int stage_first_input(int j) {
    const int lane = threadIdx.x % WARP;
    const int t = 2 * (lane >> 4) + ((lane >> 3) & 1), m = (lane >> 1) & 3, b = lane & 1;
    return j * MV_TILE + 32 * t + 8 * m + b;
}

// Stage tile j from this lane's loaded inputs `e` (value, square); one warp. Returns the tile's sum of squares.
template <int COLS, typename TileScale>
__device__ __forceinline__ float stage_tile(const float2 (&e)[4], const TileScale& tile_scale, int j,
                                            StagedX<COLS>& st) {
    constexpr int TILES = COLS / MV_TILE;
    const int lane = threadIdx.x % WARP;
    const int t = 2 * (lane >> 4) + ((lane >> 3) & 1), m = (lane >> 1) & 3, b = lane & 1;
    float mx = fmaxf(fmaxf(fabsf(e[0].x), fabsf(e[1].x)), fmaxf(fabsf(e[2].x), fabsf(e[3].x)));
    float sum = (e[0].x + e[1].x) + (e[2].x + e[3].x);
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) {
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        sum += __shfl_xor_sync(0xffffffffu, sum, o);
    }
    const float sq = warp_sum((e[0].y + e[1].y) + (e[2].y + e[3].y));
    const float up = mx > 0.f ? 127.f / mx : 0.f;
    u32 parts[MV_PARTS] = {0u, 0u, 0u};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float y = e[i].x * up;  // |y| <= 127; each remainder is at most 1/2, times 128
#pragma unroll
        for (int p = 0; p < MV_PARTS; p++) {
            const float q = rintf(y);
            parts[p] |= byte_of(q, i);
            y = (y - q) * 128.f;
        }
    }
#pragma unroll
    for (int p = 0; p < MV_PARTS; p++)
        reinterpret_cast<u32*>(st.x8)[(((p * TILES + j) * 4 + t) * 4 + m) * 2 + b] = parts[p];
    const float mx2 = __shfl_sync(0xffffffffu, mx, 16), sum2 = __shfl_sync(0xffffffffu, sum, 16);
    if (lane == 0) {
        const float ts = tile_scale(sq);
        const float s1 = mx / 127.f * ts, s2 = mx2 / 127.f * ts;
        st.gc[j] = make_float4(s1, s2, sum * ts, sum2 * ts);
        st.gc[TILES + j] = make_float4(s1 / 128.f, s2 / 128.f, 0.f, 0.f);
        st.gc[2 * TILES + j] = make_float4(s1 / 16384.f, s2 / 16384.f, 0.f, 0.f);
        st.gc[3 * TILES + j] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    if (j == 0 && lane < 2) st.x8[MV_PARTS * TILES * 8 + lane] = make_uint4(0u, 0u, 0u, 0u);
    return sq;
}

// Stages all of the input, warp `warp` of WARPS taking tiles warp, warp + WARPS, ...: `prefetch` before the wait
// for the previous kernel, `stage` after it (the caller synchronises; it returns the sum of squares of this
// warp's tiles). Every load of a phase is issued before the first use, and without branches (a warp past the last
// tile reads the last tile again).
template <int COLS, int WARPS, typename Input, typename TileScale = NoTileScale>
struct Stager {
    static constexpr int TILES = COLS / MV_TILE, PER = (TILES + WARPS - 1) / WARPS;
    Input input;
    TileScale tile_scale;
    typename Input::Early early[PER][4];

    __device__ __forceinline__ static int first_input(int p, int warp) {
        return stage_first_input(min(warp + p * WARPS, TILES - 1));
    }
    __device__ __forceinline__ void prefetch(int warp) {
#pragma unroll
        for (int p = 0; p < PER; p++)
#pragma unroll
            for (int i = 0; i < 4; i++) early[p][i] = input.fetch_early(first_input(p, warp) + 2 * i);
    }
    __device__ __forceinline__ float stage(StagedX<COLS>& st, int warp) const {
        typename Input::Raw raw[PER][4];
#pragma unroll
        for (int p = 0; p < PER; p++)
#pragma unroll
            for (int i = 0; i < 4; i++) raw[p][i] = input.fetch(first_input(p, warp) + 2 * i);
        asm volatile("" ::: "memory");  // keeps the compiler from moving each load down to its use
        float sq = 0.f;
#pragma unroll
        for (int p = 0; p < PER; p++) {
            float2 e[4];
#pragma unroll
            for (int i = 0; i < 4; i++) e[i] = input.element(raw[p][i], early[p][i]);
            if (warp + p * WARPS < TILES) sq += stage_tile<COLS>(e, tile_scale, warp + p * WARPS, st);
        }
        return sq;
    }
};

__device__ __forceinline__ void mma_u4s8(int (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One lane's view of a strip of 16 rows of a COLS-wide 4-bit matrix: loads tiles, and accumulates a loaded tile's
// products for rows g and g + 8 (this lane's part of them); `row_total` then gives rows g (lane t = 0) and g + 8
// (t = 1) whole.
template <int COLS>
struct StripLane {
    static constexpr int TILES = COLS / MV_TILE;
    struct Tile {
        uint4 g, g8;    // rows g and g + 8, lane t's 32 inputs
        uint2 sg, sg8;  // their (scale, bias) for the tile's two groups
    };
    int g, t;
    const uint4* x;      // this lane's staged part (or the zero block)
    int x_step;          // uint4s between tiles (0 on the zero block)
    const float4* gc;    // this lane's part's scales and sums

    __device__ __forceinline__ void init(const StagedX<COLS>& st) {
        const int lane = threadIdx.x % WARP;
        g = lane >> 2;
        t = lane & 3;
        const bool gives_x = g < 2 * MV_PARTS && (g & 1) == (t >> 1);
        x = gives_x ? st.x8 + ((g >> 1) * TILES * 4 + t) * 2 : st.x8 + MV_PARTS * TILES * 8;
        x_step = gives_x ? 8 : 0;
        gc = st.gc + t * TILES;
    }
    // Rows `row0 + g` and `row0 + g + 8` (each clamped below `rows`), tile j; TILED: of a tiled matrix, whose
    // pieces are the tiles.
    template <bool TILED = false>
    __device__ __forceinline__ Tile load(Q4 m, int row0, int rows, int j) const {
        static_assert(!TILED || MV_TILE == TILED_PIECE, "a tile is a piece of the tiled layout");
        const int rg = min(row0 + g, rows - 1), rg8 = min(row0 + g + 8, rows - 1);
        auto words = [&](int r) {
            return TILED ? tiled_row(m, r, COLS) + j * TILED_PIECE_STEP : m.packed + (size_t)r * (COLS / 8) + j * (MV_TILE / 8);
        };
        auto pairs = [&](int r) {
            return TILED ? tiled_row_pairs(m, r, COLS) + j * TILED_PAIR_STEP : m.scale_bias + (size_t)r * (COLS / GROUP) + 2 * j;
        };
        Tile tile;
        tile.g = load_stream(words(rg) + 4 * t);
        tile.g8 = load_stream(words(rg8) + 4 * t);
        tile.sg = *reinterpret_cast<const uint2*>(pairs(rg));
        tile.sg8 = *reinterpret_cast<const uint2*>(pairs(rg8));
        return tile;
    }
    // acc += this lane's part of tile j's products for rows g (x) and g + 8 (y).
    __device__ __forceinline__ void dot(const Tile& tile, int j, float2& acc) const {
        const u32 wg[4] = {tile.g.x, tile.g.y, tile.g.z, tile.g.w};
        const u32 w8[4] = {tile.g8.x, tile.g8.y, tile.g8.z, tile.g8.w};
        const uint4 xa = x[j * x_step], xb = x[j * x_step + 1];
        const u32 b[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
        int c[4] = {0, 0, 0, 0};
#pragma unroll
        for (int m = 0; m < 4; m++)
            mma_u4s8(c, wg[m] & 0x0F0F0F0Fu, w8[m] & 0x0F0F0F0Fu, (wg[m] >> 4) & 0x0F0F0F0Fu,
                     (w8[m] >> 4) & 0x0F0F0F0Fu, b[2 * m], b[2 * m + 1]);
        scale(tile.sg, tile.sg8, c, j, acc);
    }

    // The same for an 8-bit matrix: lane t's 32 inputs of a row are 32 bytes, and a byte permute gives A the
    // order the 4-bit words give it (inputs 8m + 0, 2, 4, 6, then 8m + 1, 3, 5, 7).
    struct Tile8 {
        uint4 g[2], g8[2];
        uint2 sg, sg8;
    };
    __device__ __forceinline__ Tile8 load8(Q4 m, int row0, int rows, int j) const {
        const int rg = min(row0 + g, rows - 1), rg8 = min(row0 + g + 8, rows - 1);
        const u32* pg = m.packed + (size_t)rg * (COLS / 4) + j * (MV_TILE / 4) + 8 * t;
        const u32* pg8 = m.packed + (size_t)rg8 * (COLS / 4) + j * (MV_TILE / 4) + 8 * t;
        Tile8 tile;
        tile.g[0] = load_stream(pg), tile.g[1] = load_stream(pg + 4);
        tile.g8[0] = load_stream(pg8), tile.g8[1] = load_stream(pg8 + 4);
        tile.sg = *reinterpret_cast<const uint2*>(m.scale_bias + (size_t)rg * (COLS / GROUP) + 2 * j);
        tile.sg8 = *reinterpret_cast<const uint2*>(m.scale_bias + (size_t)rg8 * (COLS / GROUP) + 2 * j);
        return tile;
    }
    __device__ __forceinline__ void dot8(const Tile8& tile, int j, float2& acc) const {
        const u32 wg[8] = {tile.g[0].x, tile.g[0].y, tile.g[0].z, tile.g[0].w, tile.g[1].x, tile.g[1].y, tile.g[1].z, tile.g[1].w};
        const u32 w8[8] = {tile.g8[0].x, tile.g8[0].y, tile.g8[0].z, tile.g8[0].w,
                           tile.g8[1].x, tile.g8[1].y, tile.g8[1].z, tile.g8[1].w};
        const uint4 xa = x[j * x_step], xb = x[j * x_step + 1];
        const u32 b[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
        int c[4] = {0, 0, 0, 0};
#pragma unroll
        for (int m = 0; m < 4; m++)
            mma_u4s8(c, __byte_perm(wg[2 * m], wg[2 * m + 1], 0x6420), __byte_perm(w8[2 * m], w8[2 * m + 1], 0x6420),
                     __byte_perm(wg[2 * m], wg[2 * m + 1], 0x7531), __byte_perm(w8[2 * m], w8[2 * m + 1], 0x7531),
                     b[2 * m], b[2 * m + 1]);
        scale(tile.sg, tile.sg8, c, j, acc);
    }

    // The groups' scales and biases applied to tile j's integer sums.
    __device__ __forceinline__ void scale(uint2 sg, uint2 sg8, const int (&c)[4], int j, float2& acc) const {
        const float4 k = gc[j];
        const float2 f1 = pair_to_float2(sg.x), f2 = pair_to_float2(sg.y);
        const float2 h1 = pair_to_float2(sg8.x), h2 = pair_to_float2(sg8.y);
        acc.x = fmaf(f1.x * k.x, (float)c[0], fmaf(f2.x * k.y, (float)c[1], fmaf(f1.y, k.z, fmaf(f2.y, k.w, acc.x))));
        acc.y = fmaf(h1.x * k.x, (float)c[2], fmaf(h2.x * k.y, (float)c[3], fmaf(h1.y, k.z, fmaf(h2.y, k.w, acc.y))));
    }
    // The quad's parts summed: row g on lane t = 0, row g + 8 on lane t = 1.
    __device__ __forceinline__ float row_total(float2 acc) const {
#pragma unroll
        for (int o = 1; o < 4; o <<= 1) {
            acc.x += __shfl_xor_sync(0xffffffffu, acc.x, o);
            acc.y += __shfl_xor_sync(0xffffffffu, acc.y, o);
        }
        return t == 0 ? acc.x : acc.y;
    }
    __device__ __forceinline__ bool holds_row() const { return t < 2; }
    __device__ __forceinline__ int row() const { return g + 8 * t; }
};

// Rows of a 4-bit matrix times a vector, for blocks of MV_THREADS threads: KSPLIT warps share a strip of 16 rows
// (each takes TILES / KSPLIT consecutive tiles), so a block takes 16 * STRIPS rows at a time, in turn over the
// grid (the input is staged once per block). `store` is called once per row.
#define MV_THREADS 256
// Warps sharing a strip: 4 for the 2048-wide matrices (two strips a block), 8 for the 4096-wide output projections
// (one strip a block: 128 blocks for their 2048 rows).
#define MV_KSPLIT_HIDDEN 4
#define MV_KSPLIT_WIDE 8
template <int COLS, int KSPLIT_WANTED>
struct Matvec {
    static constexpr int TILES = COLS / MV_TILE;
    static constexpr int KSPLIT = KSPLIT_WANTED < TILES ? KSPLIT_WANTED : TILES;
    static constexpr int TPW = TILES / KSPLIT;
    static constexpr int WARPS = MV_THREADS / WARP;
    static constexpr int STRIPS = WARPS / KSPLIT;
    static constexpr int ROWS_PER_BLOCK = 16 * STRIPS;
    static_assert(COLS % MV_TILE == 0 && TILES % KSPLIT == 0 && WARPS % KSPLIT == 0, "tiles split evenly");
    static_assert(ROWS_PER_BLOCK <= MV_THREADS, "a thread stores at most one row of a pass");
    typedef StripLane<COLS> Lane;
    struct Shared {
        StagedX<COLS> st;
        float part[KSPLIT][ROWS_PER_BLOCK];
        float sum_sq[WARPS];
    };

    // `stager` stages the input (its early part requested with the first tiles' weights, before the wait);
    // `out.before(row)` loads what the store needs (after the wait, with the staging) and `out.store(row, value,
    // sum_sq, before)` gets the block's sum of squares for a norm applied after the products.
    template <typename Staging, typename Out>
    __device__ __forceinline__ static void run(Shared& sh, Q4 m, int rows, Staging& stager, Out& out) {
        const int warp = threadIdx.x / WARP;
        const int strip = warp / KSPLIT, kpart = warp % KSPLIT;
        Lane lane;
        lane.init(sh.st);
        typename Lane::Tile tiles[TPW];
        auto load = [&](int first_row) {
#pragma unroll
            for (int i = 0; i < TPW; i++) tiles[i] = lane.load(m, first_row + 16 * strip, rows, kpart * TPW + i);
        };
        int first_row = blockIdx.x * ROWS_PER_BLOCK;
        if (first_row < rows) load(first_row);
        stager.prefetch(warp);
        wait_previous();
        const int own_row = threadIdx.x < ROWS_PER_BLOCK ? threadIdx.x : 0;
        float before = first_row + own_row < rows ? out.before(first_row + own_row) : 0.f;
        const float sq = stager.stage(sh.st, warp);
        if (threadIdx.x % WARP == 0) sh.sum_sq[warp] = sq;
        __syncthreads();
        float sum_sq = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; w++) sum_sq += sh.sum_sq[w];
        for (; first_row < rows; first_row += gridDim.x * ROWS_PER_BLOCK) {
            float2 acc = make_float2(0.f, 0.f);
#pragma unroll
            for (int i = 0; i < TPW; i++) lane.dot(tiles[i], kpart * TPW + i, acc);
            const float v = lane.row_total(acc);
            const int next = first_row + gridDim.x * ROWS_PER_BLOCK;
            if (next < rows) load(next);
            if (lane.holds_row()) sh.part[kpart][16 * strip + lane.row()] = v;
            __syncthreads();
            if (threadIdx.x < ROWS_PER_BLOCK && first_row + threadIdx.x < rows) {
                float s = 0.f;
#pragma unroll
                for (int k = 0; k < KSPLIT; k++) s += sh.part[k][threadIdx.x];
                out.store(first_row + threadIdx.x, s, sum_sq, before);
            }
            if (next < rows && next + own_row < rows) before = out.before(next + own_row);
            __syncthreads();
        }
    }
};

// Where a matrix-vector product's rows go: through the RMSNorm's 1 / rms into `out`, or added to the residual.
struct RmsNormedOut {
    float* out;
    __device__ __forceinline__ float before(int) const { return 0.f; }
    __device__ __forceinline__ void store(int r, float v, float sum_sq, float) const { out[r] = v * rms_inv(sum_sq, HIDDEN); }
};
struct ResidualOut {
    float* hidden;
    __device__ __forceinline__ float before(int r) const { return hidden[r]; }
    __device__ __forceinline__ void store(int r, float v, float, float old) const { hidden[r] = old + v; }
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// The warpgroup MMAs' plumbing (sm_90a), shared by the products and the prefill's attention. A shared memory
// operand of wgmma: its start (a tile's 1,024-byte aligned base plus the k16 step's 32-byte offset in its 128-byte
// rows), 1,024 bytes between groups of eight rows, 128-byte swizzle (a row's 16-byte chunk c at c ^ (row % 8)).
__device__ __forceinline__ u64 wgmma_desc(u32 addr) {
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Transaction barriers in shared memory (mbarrier), as the bulk tensor copies complete them. A barrier made for one
// arrival finishes a phase when that arrival (which announces the bytes to come) has happened and all those bytes
// have landed; a waiter names the phase by its parity (0 for the first).
__device__ __forceinline__ void mbarrier_init(u32 bar, u32 arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(arrivals) : "memory");
}
// Makes the barriers this thread initialised visible to the copies and to the other threads (before a barrier).
__device__ __forceinline__ void mbarrier_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
// This thread's arrival, announcing `bytes` of copies that complete the phase.
__device__ __forceinline__ void mbarrier_arrive_expect(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
// Waits until the phase of the given parity has finished; the copies' bytes are then visible to this thread.
__device__ __forceinline__ void mbarrier_wait(u32 bar, u32 parity) {
    u32 done;
    do {
        asm volatile(
            "{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\tselp.u32 %0, 1, 0, p;\n\t}"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    } while (!done);
}
// Copies the box of `map` at coordinates (c0, c1) (innermost first) to shared address `dst`, completing `bytes`
// (the whole box: elements past the tensor's edge arrive as zeros) on barrier `bar`.
__device__ __forceinline__ void tma_load_2d(u32 dst, const TmaMap& map, int c0, int c1, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(dst),
        "l"((u64)&map), "r"(c0), "r"(c1), "r"(bar)
        : "memory");
}
// Copies `bytes` (a multiple of 16) from global `src` to shared address `dst` (both 16-byte aligned) as one bulk
// copy, completing those bytes on barrier `bar`.
__device__ __forceinline__ void bulk_load(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}
// An arrival on `bar` once every cp.async this thread has issued so far has landed. The barrier's count must
// include it (noinc: the arrival is not added to the phase's pending count when it is requested).
__device__ __forceinline__ void cp_async_arrive(u32 bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
// This thread's arrival, announcing no bytes.
__device__ __forceinline__ void mbarrier_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// Stores the box at shared address `src` to `map`'s tensor at coordinates (c0, c1), or adds it there (f32) with
// ADD; elements past the tensor's edge are not written. After tma_store_wait the box's shared memory may be reused;
// the global writes finish on their own, before the grid counts as complete.
template <bool ADD>
__device__ __forceinline__ void tma_store_2d(const TmaMap& map, int c0, int c1, u32 src) {
    if constexpr (ADD)
        asm volatile("cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2}], [%3];" ::"l"(
                         (u64)&map),
                     "r"(c0), "r"(c1), "r"(src)
                     : "memory");
    else
        asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group [%0, {%1, %2}], [%3];" ::"l"((u64)&map),
                     "r"(c0), "r"(c1), "r"(src)
                     : "memory");
}
// Commits this thread's bulk stores as a group and waits until they have read their shared memory.
__device__ __forceinline__ void tma_store_wait() {
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}
// Keeps the compiler from moving reads or writes of an accumulator across the asynchronous MMAs.
template <int R>
__device__ __forceinline__ void wgmma_hold(float (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; i++) asm volatile("" : "+f"(d[i])::"memory");
}
template <int R>
__device__ __forceinline__ void wgmma_hold(int (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; i++) asm volatile("" : "+r"(d[i])::"memory");
}
#endif

// Counter-based random numbers, the twin of lily_model::rng (synthetic weights and sampling draw the same
// numbers on CPU and GPU).
__device__ __forceinline__ u64 mix64(u64 z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
__device__ __forceinline__ u64 hash3(u64 seed, u64 stream, u64 index) {
    return mix64(seed ^ mix64((stream + 0x9e3779b97f4a7c15ull) ^ mix64(index)));
}
__device__ __forceinline__ float uniform_at(u64 seed, u64 stream, u64 index) {
    return (float)(hash3(seed, stream, index) >> 40) * (1.f / 16777216.f);
}

// ---- The split products' partial tiles (kernels/gemm.cu's gemm_partials) ----
// A product whose k is cut into parts leaves each part's tile of SPLIT_TILE_ROWS output rows by SPLIT_TILE_COLS
// columns in the slots: of `tiles` = ceil(n / SPLIT_TILE_COLS) x ceil(m / SPLIT_TILE_ROWS) tiles, part p's tile
// (column block cb, row block r / SPLIT_TILE_ROWS) at slot p tiles + cb + ceil(n / SPLIT_TILE_COLS) (r /
// SPLIT_TILE_ROWS), row r % SPLIT_TILE_ROWS, column col % SPLIT_TILE_COLS. gemm_split_sum adds the parts; a kernel
// that reads the product's output next may add them itself (rmsnorm_rows).
#define SPLIT_TILE_ROWS 64
#define SPLIT_TILE_COLS 256
#define SPLIT_SUM_BATCH 8
// The sum over `parts` parts, in order, of output row r's columns col .. col + 3 (col % 4 == 0) of a product of m
// rows and n columns whose parts start at `partials`. The loads of SPLIT_SUM_BATCH parts are in flight together (a
// part's partial comes from L2), the adds in order, so every caller gets the same bits.
__device__ __forceinline__ float4 split_parts_sum(const float* partials, int r, int col, int m, int n, int parts) {
    const int col_blocks = (n + SPLIT_TILE_COLS - 1) / SPLIT_TILE_COLS;
    const int tiles = col_blocks * ((m + SPLIT_TILE_ROWS - 1) / SPLIT_TILE_ROWS);
    const int tile = col / SPLIT_TILE_COLS + col_blocks * (r / SPLIT_TILE_ROWS);
    const float* at = partials + (size_t)tile * SPLIT_TILE_ROWS * SPLIT_TILE_COLS +
                      (r % SPLIT_TILE_ROWS) * SPLIT_TILE_COLS + col % SPLIT_TILE_COLS;
    const size_t part_stride = (size_t)tiles * SPLIT_TILE_ROWS * SPLIT_TILE_COLS;
    float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int p0 = 0; p0 < parts; p0 += SPLIT_SUM_BATCH) {
        float4 v[SPLIT_SUM_BATCH];
#pragma unroll
        for (int u = 0; u < SPLIT_SUM_BATCH; u++)
            v[u] = p0 + u < parts ? __ldcg((const float4*)(at + (p0 + u) * part_stride)) : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int u = 0; u < SPLIT_SUM_BATCH; u++) s.x += v[u].x, s.y += v[u].y, s.z += v[u].z, s.w += v[u].w;
    }
    return s;
}

// ---- Q8x2: activations as two 8-bit digits an input (the integer small tiling's input, kernels/gemm.cu) ----
// Q8x2 rows. A row of k inputs is k / 64 groups of 128 bytes: word w of a group (its inputs 8w .. 8w + 7) is 16
// bytes, digit 0 then digit 1, each as the bytes of the 4 even inputs, then of the 4 odd ones (the order in which
// a weight word's low and high nibbles give A). x = s (d0 + d1 / 128) with s = max |x| / 127 over the group,
// |d0| <= 127, |d1| <= 64 (the decode's staging with two of its three digits). Beside the codes, each group's pair
// {s / 128, sum of the group's inputs}. The integer sums stay below 2^24, so 128 C0 + C1 converts to f32 exactly.
#define Q8X2_GROUP_BYTES 128
#define Q8X2_WORD_BYTES 16
struct Q8x2 {
    u32* codes;
    float* pairs;
};

// Codes the 8 inputs `v` of word `word` of a group as Q8x2, given the group's largest magnitude `mx` and the sum
// of its inputs: writes the word's 16 bytes to `code` and (word 0) the group's pair to `pair`, where `valid`.
__device__ __forceinline__ void code_word_q8x2(const float (&v)[8], float mx, float sum, int word, bool valid,
                                               uint4* code, float2* pair) {
    const float up = mx > 0.f ? 127.f / mx : 0.f;
    u32 d[2][2] = {{0u, 0u}, {0u, 0u}};  // [digit][even inputs, odd inputs]
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const float y = v[i] * up;  // |y| <= 127
        const float q0 = rintf(y);
        const float q1 = rintf((y - q0) * 128.f);  // the remainder is at most 1/2: |q1| <= 64
        d[0][i & 1] |= byte_of(q0, i >> 1);
        d[1][i & 1] |= byte_of(q1, i >> 1);
    }
    if (!valid) return;
    *code = make_uint4(d[0][0], d[0][1], d[1][0], d[1][1]);
    if (word == 0) *pair = make_float2(mx / 127.f / 128.f, sum);
}

// Quantizes the 8 inputs `v` of word `word` of a group to Q8x2, with the other 7 words of the group on the 7 lanes
// next to this one (lanes 8i .. 8i + 7 hold a group); every lane of the warp calls it. Writes the word's 16 bytes
// to `code` and (word 0) the group's pair to `pair`, where `valid`. STRIDE s > 1: word w of a group lies on lane
// 8 s i + s w (and again on the s - 1 lanes after it, for a caller whose lanes hold a part of a word each), with
// the same sums in the same order, so the same codes and pairs.
template <int STRIDE = 1>
__device__ __forceinline__ void quantize_word_q8x2(const float (&v)[8], int word, bool valid, uint4* code,
                                                   float2* pair) {
    float mx = 0.f, sum = 0.f;
#pragma unroll
    for (int i = 0; i < 8; i++) mx = fmaxf(mx, fabsf(v[i])), sum += v[i];
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) {
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o * STRIDE));
        sum += __shfl_xor_sync(0xffffffffu, sum, o * STRIDE);
    }
    code_word_q8x2(v, mx, sum, word, valid, code, pair);
}
