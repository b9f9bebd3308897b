// Shared by every kernel file (prepended to each at compile time). The model's dimensions arrive as -D defines
// from the Config (see kernels.rs), so the tiny and the full model run the same code.
//
// Quantized matrices: MLX's packed 4-bit (or 8-bit) rows, `cols * bits / 32` u32 words a row, low bits first;
// beside them one bf16x2 (scale, bias) per group of 64 inputs, `[rows][cols / 64]` (repacked from MLX's two
// arrays so one 4-byte load gives both).

typedef unsigned int u32;
typedef unsigned long long u64;
// bf16 as raw bits: NVRTC's own headers are all the kernels rely on, so CI compiles them with NVRTC alone.
typedef unsigned short bf16;
#define INF_F __int_as_float(0x7f800000)

__device__ __forceinline__ float bf16_to_float(bf16 h) { return __uint_as_float((u32)h << 16); }
// Round to nearest even, as half::bf16::from_f32.
__device__ __forceinline__ bf16 float_to_bf16(float f) {
    const u32 b = __float_as_uint(f);
    if ((b & 0x7fffffffu) > 0x7f800000u) return (bf16)((b >> 16) | 0x40u);
    return (bf16)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}
// A (scale, bias) pair: scale in the low half (the lower address), bias in the high half.
__device__ __forceinline__ float2 pair_to_float2(u32 p) {
    return make_float2(__uint_as_float(p << 16), __uint_as_float(p & 0xffff0000u));
}

#define GROUP 64
#define WARP 32

struct Q4 {
    const u32* packed;
    const u32* scale_bias;
};

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

// 2^23 + q as a float's bits, minus 2^23: a 4-bit integer to float in two integer/float ops, no conversion unit.
__device__ __forceinline__ float nibble_to_float(u32 word, int shift) {
    return __uint_as_float(0x4B000000u | ((word >> shift) & 0xFu)) - 8388608.f;
}
__device__ __forceinline__ float byte_to_float(u32 word, int shift) {
    return __uint_as_float(0x4B000000u | ((word >> shift) & 0xFFu)) - 8388608.f;
}

// 1 + q/16 for the 4-bit value q at bits 4j..4j+3: the nibble moved under the exponent of 1.0 (mantissa bits
// 19..22), a shift and a mask-or, so a weight costs one FMA more instead of a conversion.
// The mask-or is one explicit lop3: written in C, the compiler emits an AND and an OR (a LOP3 takes one
// immediate), a third integer instruction a weight.
__device__ __forceinline__ float nibble_one_plus(u32 word, int j) {
    const u32 at19 = 4 * j <= 19 ? word << (19 - 4 * j) : word >> (4 * j - 19);
    u32 bits;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(bits) : "r"(at19), "n"(0x00780000u), "r"(0x3F800000u));
    return __uint_as_float(bits);
}

// sum_i (1 + q_i/16) x_i over the 32 4-bit values of one 16-byte load; sum_i q_i x_i = 16 (that - sum_i x_i).
__device__ __forceinline__ float dot_q4x32_one_plus(uint4 w, const float (&x)[32]) {
    float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        a0 = fmaf(nibble_one_plus(w.x, j), x[j], a0);
        a1 = fmaf(nibble_one_plus(w.y, j), x[8 + j], a1);
        a2 = fmaf(nibble_one_plus(w.z, j), x[16 + j], a2);
        a3 = fmaf(nibble_one_plus(w.w, j), x[24 + j], a3);
    }
    return (a0 + a1) + (a2 + a3);
}

// The input vector of a matrix-vector product lives in shared memory with the 32 floats of each 16-byte weight
// load swizzled (element j of chunk u at 32u + (j ^ (u % 32))), so that lanes loading consecutive chunks into
// registers hit 32 different banks.
__device__ __forceinline__ int swz(int c) { return (c & ~31) | ((c & 31) ^ ((c >> 5) & 31)); }

// One warp's share of 4-bit matrix rows: the warp reads the SEG inputs starting at `seg0` of rows `COLS` wide;
// each row is read by LPR lanes, RPP rows a pass; a lane keeps its UPL chunks of 32 inputs in registers for
// every row it reads.
template <int SEG, int COLS>
struct RowDot4 {
    static constexpr int CHUNKS = SEG / 32;
    static constexpr int LPR = CHUNKS < WARP ? CHUNKS : WARP;
    static constexpr int RPP = WARP / LPR;
    static constexpr int UPL = CHUNKS / LPR;
    static_assert(SEG % GROUP == 0 && COLS % SEG == 0, "segments must be whole groups");
    float x[UPL][32];
    float xsum[UPL];
    int sub;  // this lane's place among the LPR lanes of its row
    int seg0;

    __device__ __forceinline__ void init(int seg_start) {
        sub = (threadIdx.x % WARP) % LPR;
        seg0 = seg_start;
    }
    __device__ __forceinline__ void load_x(const float* xs_swizzled) {
#pragma unroll
        for (int k = 0; k < UPL; k++) {
            const int u = seg0 / 32 + sub + LPR * k;
            float s = 0.f;
#pragma unroll
            for (int j = 0; j < 32; j++) {
                x[k][j] = xs_swizzled[32 * u + (j ^ (u & 31))];
                s += x[k][j];
            }
            xsum[k] = s;
        }
    }
    // The lane's row in the current pass, relative to the pass's first row.
    __device__ __forceinline__ int row_in_pass() const { return (threadIdx.x % WARP) / LPR; }

    __device__ __forceinline__ void load_row(Q4 m, int row, uint4 (&w)[UPL], u32 (&sb)[UPL]) const {
#pragma unroll
        for (int k = 0; k < UPL; k++) {
            const int u = seg0 / 32 + sub + LPR * k;
            w[k] = load_stream(m.packed + (size_t)row * (COLS / 8) + 4 * u);
            sb[k] = m.scale_bias[(size_t)row * (COLS / GROUP) + u / 2];
        }
    }
    // This lane's part of the row's dot product; `reduce` sums the LPR parts.
    __device__ __forceinline__ float partial(const uint4 (&w)[UPL], const u32 (&sb)[UPL]) const {
        float acc = 0.f;
#pragma unroll
        for (int k = 0; k < UPL; k++) {
            const float2 f = pair_to_float2(sb[k]);
            acc += f.x * 16.f * (dot_q4x32_one_plus(w[k], x[k]) - xsum[k]) + f.y * xsum[k];
        }
        return acc;
    }
    __device__ __forceinline__ static float reduce(float v) {
#pragma unroll
        for (int o = LPR / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        return v;
    }
};

// Rows of a 4-bit matrix times the swizzled shared vector `xs` (COLS long), for blocks of MV_THREADS threads
// that take tiles of ROWS_PER_BLOCK rows in turn (the input is prepared once per block, not once per tile).
// Inputs wider than MV_SEG are split over several warps whose parts meet in shared memory. `store(row, value)` is
// called once per row, by one thread.
#define MV_THREADS 256
#define MV_SEG 2048
template <int COLS>
struct Matvec {
    static constexpr int NSEG = COLS > MV_SEG ? COLS / MV_SEG : 1;
    static constexpr int SEG = COLS / NSEG;
    typedef RowDot4<SEG, COLS> Dot;
    static constexpr int PASSES = Dot::UPL >= 2 ? 2 : 4;
    static constexpr int GROUPS = (MV_THREADS / WARP) / NSEG;
    static constexpr int ROWS_PER_BLOCK = GROUPS * PASSES * Dot::RPP;
    static_assert((MV_THREADS / WARP) % NSEG == 0, "segments must divide the warps");

    // `prologue()` fills `xs` (ending with a barrier); it runs after the first tile's weights are requested, so
    // their latency overlaps it.
    template <typename Prologue, typename Store>
    __device__ __forceinline__ static void run(const float* xs, Q4 m, int rows, float* acc_smem, Prologue prologue,
                                               Store store) {
        const int warp = threadIdx.x / WARP;
        const int seg = warp % NSEG, group = warp / NSEG;
        Dot d;
        d.init(seg * SEG);
        const int base = group * PASSES * Dot::RPP;
        uint4 w[PASSES][Dot::UPL];
        u32 sb[PASSES][Dot::UPL];
        auto load_tile = [&](int first_row) {
#pragma unroll
            for (int p = 0; p < PASSES; p++) {
                const int row = min(first_row + base + p * Dot::RPP + d.row_in_pass(), rows - 1);
                d.load_row(m, row, w[p], sb[p]);
            }
        };
        int first_row = blockIdx.x * ROWS_PER_BLOCK;
        if (first_row < rows) load_tile(first_row);
        prologue();
        d.load_x(xs);
        for (; first_row < rows; first_row += gridDim.x * ROWS_PER_BLOCK) {
            if (first_row != blockIdx.x * ROWS_PER_BLOCK) load_tile(first_row);
            if (NSEG > 1) {
                for (int i = threadIdx.x; i < ROWS_PER_BLOCK; i += blockDim.x) acc_smem[i] = 0.f;
                __syncthreads();
            }
#pragma unroll
            for (int p = 0; p < PASSES; p++) {
                const int local = base + p * Dot::RPP + d.row_in_pass();
                const float v = Dot::reduce(d.partial(w[p], sb[p]));
                if (d.sub == 0 && first_row + local < rows) {
                    if (NSEG > 1) atomicAdd(&acc_smem[local], v);
                    else store(first_row + local, v);
                }
            }
            if (NSEG > 1) {
                __syncthreads();
                for (int i = threadIdx.x; i < ROWS_PER_BLOCK; i += blockDim.x)
                    if (first_row + i < rows) store(first_row + i, acc_smem[i]);
                __syncthreads();
            }
        }
    }
};

// The prologues below issue every global load before the first use: a loop that loads, uses and stores one
// element at a time waits out the cache latency once per element.

// xs = hidden * rsqrt(mean(hidden^2) + eps) * norm (zero-centred RMSNorm, scale stored as 1 + w), written
// swizzled (or plain) into shared memory by a block of THREADS threads. Ends with a barrier.
template <int N, int THREADS, bool SWIZZLE>
__device__ __forceinline__ void rmsnorm_to_shared(const float* hidden, const float* norm, float* xs, float* scratch) {
    constexpr int PER = (N + THREADS - 1) / THREADS;
    float h[PER], w[PER];
#pragma unroll
    for (int i = 0; i < PER; i++) {
        const int c = threadIdx.x + i * THREADS;
        h[i] = c < N ? hidden[c] : 0.f;
        w[i] = c < N ? norm[c] : 0.f;
    }
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < PER; i++) s += h[i] * h[i];
    const float inv = 1.f / sqrtf(block_sum(s, scratch) / N + RMS_EPS);
#pragma unroll
    for (int i = 0; i < PER; i++) {
        const int c = threadIdx.x + i * THREADS;
        if (c < N) xs[SWIZZLE ? swz(c) : c] = h[i] * inv * w[i];
    }
    __syncthreads();
}

// xs[swz(c)] = src[c] for c < N, by the THREADS threads numbered `index` (a block, or a warp's lanes).
template <int N, int THREADS>
__device__ __forceinline__ void copy_to_shared_swizzled(const float* src, float* xs, int index) {
    constexpr int PER = (N + THREADS - 1) / THREADS;
    float v[PER];
#pragma unroll
    for (int i = 0; i < PER; i++) {
        const int c = index + i * THREADS;
        v[i] = c < N ? src[c] : 0.f;
    }
#pragma unroll
    for (int i = 0; i < PER; i++) {
        const int c = index + i * THREADS;
        if (c < N) xs[swz(c)] = v[i];
    }
}

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

// Softmax over the router logits, the TOP_K largest (lowest index first on ties), renormalised; one warp.
__device__ void route(const float* logits, int* ids, float* weights) {
    constexpr int PER_LANE = (NUM_EXPERTS + WARP - 1) / WARP;
    const int lane = threadIdx.x % WARP;
    float v[PER_LANE];
    float mx = -INF_F;
#pragma unroll
    for (int i = 0; i < PER_LANE; i++) {
        const int e = lane + WARP * i;
        v[i] = e < NUM_EXPERTS ? logits[e] : -INF_F;
        mx = fmaxf(mx, v[i]);
    }
    mx = warp_max(mx);
    float denom = 0.f;
#pragma unroll
    for (int i = 0; i < PER_LANE; i++)
        if (lane + WARP * i < NUM_EXPERTS) denom += expf(v[i] - mx);
    denom = warp_sum(denom);
    float chosen_sum = 0.f;
    for (int slot = 0; slot < TOP_K; slot++) {
        float best = -INF_F;
        int best_e = 0x7fffffff;
#pragma unroll
        for (int i = 0; i < PER_LANE; i++) {
            const int e = lane + WARP * i;
            if (e < NUM_EXPERTS && (v[i] > best || (v[i] == best && e < best_e))) best = v[i], best_e = e;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ob = __shfl_xor_sync(0xffffffffu, best, o);
            const int oe = __shfl_xor_sync(0xffffffffu, best_e, o);
            if (ob > best || (ob == best && oe < best_e)) best = ob, best_e = oe;
        }
#pragma unroll
        for (int i = 0; i < PER_LANE; i++)
            if (lane + WARP * i == best_e) v[i] = -INF_F;
        const float p = expf(best - mx) / denom;
        chosen_sum += p;
        if (lane == 0) ids[slot] = best_e, weights[slot] = p;
    }
    __syncwarp();
    if (lane < TOP_K) weights[lane] /= chosen_sum;
    __syncwarp();
}
