// Gated DeltaNet prefill: the whole mixer for t tokens at once, between the input projection (proj rows, f32) and
// the output projection (bf16 rows), in the chunked WY form of flash-linear-attention's chunk_gated_delta_rule
// with chunks of 64 tokens.
//
// Per value head, with state S [DK][DV] and c_r the cumulative log decay of the chunk up to its token r:
//   A[r][s] = beta_r (k_r . k_s) e^(c_r - c_s) for s < r,  T = (I + A)^-1  (unit lower triangular)
//   P[r][s] = (q_r . k_s) e^(c_r - c_s) for s <= r  (the intra-chunk attention)
//   X_r = beta_r (v_r - e^(c_r) k_r S),  V' = T X  (the WY form's U - W S, with T applied after the state read)
//   o_r = e^(c_r) q_r S + sum_s P[r][s] V'_s,  S <- e^(c_last) S + sum_s e^(c_last - c_s) k_s V'_s^T
// lily_model::cpu::deltanet::chunked is the CPU twin (it forms U = T beta v and W = T beta e^c k instead).
//
// Work split, three launches:
//  deltanet_prefill_chunks, grid (chunks, key heads), 256 threads: everything that does not need the state, every
//    chunk at once. A block reads its 64 token rows (and the conv ring before the first token), runs the causal
//    conv + SiLU of the key head's q and k and of its two value heads' v, the l2-norms and the gates, and for
//    both value heads builds A and P and inverts I + A: 16 x 16 diagonal blocks by substitution, then the
//    off-diagonal blocks by distance from the diagonal, T_ij = -T_ii sum_k A_ik T_kj. Writes q, k, v, c, beta,
//    T and P for the state pass.
//  deltanet_prefill_state, grid (value heads, STATE_SPLIT), 256 threads: the only sequential part, over the chunks in
//    order. A block owns COLS = 32 columns of one head's state (the columns of the recurrence are independent),
//    read from its f16 storage into registers (f32) and stored back after the last chunk, and keeps a tf32 operand
//    copy in shared memory; per chunk it computes [q; k] S, X, V' = T X, o and the next S. The next chunk's operands stream in with cp.async while the current one is computed, each
//    buffer refilled as soon as its last reader is done. o overwrites v in place.
//  deltanet_prefill_norm, grid (t * value heads / 8), 256 threads: the gated RMSNorm of every (token, value head)
//    into the bf16 rows of the output projection, and the conv ring's update (after the chunks kernel read it).
// Calls of at most SHORT_MAX_TOKENS tokens take deltanet_prefill_short (the recurrence token by token, below) in
// place of the first two launches.
//
// Snapshot cuts: given `cut` (1 .. t - 1, 0 for none), the chunks kernel writes the conv ring as the call's first
// `cut` tokens leave it to cut_ring, and the state kernel the state after them to cut_state, in the same pass; a
// second cut (`cut2`, cut_ring2, cut_state2) may come in a later chunk than the first. The state after token p of a
// chunk is the chunk's update with p in place of the chunk's end,
//   S_p = e^(c_p) S + sum_{s <= p} e^(c_p - c_s) k_s V'_s^T,
// since V'_s depends on the chunk's rows up to s only (T is lower triangular); at the chunk's end it is the update.
//
// Precision: every matrix product runs on tensor cores in tf32 (mma.m16n8k8, f32 accumulation): k k^T, q k^T,
// the off-diagonal blocks of T, [q; k] S, T X, P V' and k^T V'. Operands are rounded to nearest tf32 (11
// significant bits, relative error <= 2^-11) where they are stored for a product; the state, the conv, norms,
// gates, decays and every elementwise step stay f32 (the chunks kernel's SiLU and in-chunk decays with the
// hardware's exp and division, a few ulp off), and the state is rounded only in its operand copy (and to f16 when it
// is stored at the end of the call).
//
// Scratch (from the host's DeltaNetScratch), with padded = chunks * 64 (tokens past t are zeros, with g = beta = 0,
// which leaves T, the decays and the state untouched):
//   q, k: f32 [LIN_K_HEADS][padded][DK] (q scaled by 1/sqrt(DK), both tf32);  v (then o): f32
//   [LIN_V_HEADS][padded][DV];  decay (c), beta: f32 [LIN_V_HEADS][padded];  inverse (T), attn (P): f32
//   [LIN_V_HEADS][chunks][64][64] (tf32).

#define DK LIN_HEAD_DIM
#define DV LIN_HEAD_DIM
#define CHUNK 64
#define HEADS_PER_KEY (LIN_V_HEADS / LIN_K_HEADS)
#define PROJ_DIM (LIN_CONV_DIM + LIN_V_DIM + 2 * LIN_V_HEADS)
#define PREFILL_THREADS 256
#define PREFILL_WARPS (PREFILL_THREADS / WARP)
#define STATE_SPLIT 4
#define COLS (DV / STATE_SPLIT)
static_assert(DK == 128 && COLS == 32, "the warp layouts assume heads of 128 and blocks of 32 state columns");
static_assert(HEADS_PER_KEY == 2 && HEADS_PER_KEY * DV == PREFILL_THREADS, "a chunks block takes two value heads");
static_assert(CHUNK == 2 * WARP && PREFILL_WARPS == 8, "the chunk's scan and tiles assume 64 tokens, 8 warps");

#define CHUNKS_SHARED_FLOATS (2 * CHUNK * DK + 2 * CHUNK * CHUNK)
#define STATE_SHARED_FLOATS (3 * CHUNK * DK + 2 * CHUNK * CHUNK + 5 * CHUNK * COLS + DK * COLS + 4 * CHUNK)
extern "C" __device__ const int deltanet_chunks_shared_bytes = CHUNKS_SHARED_FLOATS * 4;
extern "C" __device__ const int deltanet_state_shared_bytes = STATE_SHARED_FLOATS * 4;
extern "C" __device__ const int deltanet_state_split = STATE_SPLIT;

// Round to nearest tf32 (ties away from zero), kept as an f32 whose low 13 mantissa bits are zero.
__device__ __forceinline__ float round_tf32(float x) {
    return __uint_as_float((__float_as_uint(x) + 0x1000u) & 0xffffe000u);
}

// d += a b for one 16 x 8 x 8 tile: a (16 x 8, row-major) and b (8 x 8, column-major) fragments in tf32 bits.
__device__ __forceinline__ void mma_tf32(float (&d)[4], const u32 (&a)[4], const u32 (&b)[2]) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ void cp_async16(float* shared, const float* global) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((u32)__cvta_generic_to_shared(shared)), "l"(global)
                 : "memory");
}

// Shared f32 tiles are row-major, WIDTH (a multiple of 32) floats a row, the columns of each row XOR-swizzled by
// its low 3 bits so that both ways an m16n8k8 fragment is read hit 32 different banks: 8 rows x 4 columns (an A
// fragment, or B read from a [n][k] tile) and 4 rows x 8 columns (B from a [k][n] tile, or A read transposed).
// The XOR moves whole groups of 4 floats, so 16-byte copies stay contiguous.
template <int WIDTH>
__device__ __forceinline__ int at(int r, int c) {
    return r * WIDTH + (c ^ (((r & 3) << 3) | (r & 4)));
}

// The state pass keeps the operands it reads as B (S, X, V' and the scaled copies of V') transposed, a row per
// column of the state. Scalar stores whose lanes span 4 rows 2 apart by 8 columns write them, and only ldmatrix
// (8 rows by 4 columns) reads them: their columns XOR-swizzled by 4 (row % 8) keep both ways conflict-free.
template <int WIDTH>
__device__ __forceinline__ int at_t(int r, int c) {
    return r * WIDTH + (c ^ ((r & 7) << 2));
}

// Fragment coordinates of this lane: row group g (0..7) and column pair / k index t (0..3).
__device__ __forceinline__ int frag_g() { return (threadIdx.x % WARP) / 4; }
__device__ __forceinline__ int frag_t() { return threadIdx.x % 4; }

// The A fragment of rows r0.., columns k0.. of A = tile^T.
template <int WIDTH>
__device__ __forceinline__ void load_a_transposed(u32 (&a)[4], const float* tile, int r0, int k0) {
    const int g = frag_g(), t = frag_t();
    a[0] = __float_as_uint(tile[at<WIDTH>(k0 + t, r0 + g)]);
    a[1] = __float_as_uint(tile[at<WIDTH>(k0 + t, r0 + g + 8)]);
    a[2] = __float_as_uint(tile[at<WIDTH>(k0 + t + 4, r0 + g)]);
    a[3] = __float_as_uint(tile[at<WIDTH>(k0 + t + 4, r0 + g + 8)]);
}
// The B fragment of rows k0.., columns n0.. of B = tile.
template <int WIDTH>
__device__ __forceinline__ void load_b(u32 (&b)[2], const float* tile, int k0, int n0) {
    const int g = frag_g(), t = frag_t();
    b[0] = __float_as_uint(tile[at<WIDTH>(k0 + t, n0 + g)]);
    b[1] = __float_as_uint(tile[at<WIDTH>(k0 + t + 4, n0 + g)]);
}
// Stores the accumulator tile of rows r0.., columns c0.. times `scale`, rounded to tf32.
template <int WIDTH>
__device__ __forceinline__ void store_c(float* tile, int r0, int c0, const float (&d)[4], float scale) {
    const int g = frag_g(), t = frag_t();
    *(float2*)&tile[at<WIDTH>(r0 + g, c0 + 2 * t)] = make_float2(round_tf32(d[0] * scale), round_tf32(d[1] * scale));
    *(float2*)&tile[at<WIDTH>(r0 + g + 8, c0 + 2 * t)] = make_float2(round_tf32(d[2] * scale), round_tf32(d[3] * scale));
}

// Fragments by ldmatrix, one instruction for four scalar loads: ldmatrix's 16-byte rows are runs of 4 consecutive
// columns of a swizzled row, and the 8 rows of one of its matrices fall in 8 different runs of banks.
// The A fragment of rows r0.., columns k0.. of A = tile: a[0] is tile(r0 + g, k0 + t), a[1] tile(r0 + g + 8, k0 + t),
// a[2] tile(r0 + g, k0 + t + 4), a[3] tile(r0 + g + 8, k0 + t + 4).
template <int WIDTH>
__device__ __forceinline__ void load_a_ldsm(u32 (&a)[4], const float* tile, int r0, int k0) {
    const int lane = threadIdx.x % WARP;
    const int r = r0 + (lane & 7) + 8 * ((lane >> 3) & 1), c = k0 + 4 * (lane >> 4);
    ldmatrix_x4(a, (u32)__cvta_generic_to_shared(tile + at<WIDTH>(r, c)));
}
// The B fragments of rows k0.., columns n0.. (b[0], b[1]) and n0 + 8.. (b[2], b[3]) of B = tile^T: b[0] is
// tile(n0 + g, k0 + t), b[1] tile(n0 + g, k0 + t + 4). TRANSPOSED: a tile of the state pass's B operands (at_t).
template <int WIDTH, bool TRANSPOSED>
__device__ __forceinline__ void load_b2_ldsm(u32 (&b)[4], const float* tile, int k0, int n0) {
    const int lane = threadIdx.x % WARP;
    const int r = n0 + (lane & 7) + 8 * ((lane >> 4) & 1), c = k0 + 4 * ((lane >> 3) & 1);
    ldmatrix_x4(b, (u32)__cvta_generic_to_shared(tile + (TRANSPOSED ? at_t<WIDTH>(r, c) : at<WIDTH>(r, c))));
}
// Stores the accumulator tile of rows r0.., columns c0.. times `scale`, rounded to tf32, transposed: element
// (r, c) at row c, column r of `tile` (at_t).
template <int WIDTH>
__device__ __forceinline__ void store_c_transposed(float* tile, int r0, int c0, const float (&d)[4], float scale) {
    const int g = frag_g(), t = frag_t();
    tile[at_t<WIDTH>(c0 + 2 * t, r0 + g)] = round_tf32(d[0] * scale);
    tile[at_t<WIDTH>(c0 + 2 * t + 1, r0 + g)] = round_tf32(d[1] * scale);
    tile[at_t<WIDTH>(c0 + 2 * t, r0 + g + 8)] = round_tf32(d[2] * scale);
    tile[at_t<WIDTH>(c0 + 2 * t + 1, r0 + g + 8)] = round_tf32(d[3] * scale);
}

// Copies a [ROWS][WIDTH] f32 block (rows `stride` floats apart) into a swizzled tile, 16 bytes per cp.async. A
// thread's runs lie STEP rows apart, a multiple of 8, so they share one swizzle and their addresses differ by
// constants.
template <int ROWS, int WIDTH>
__device__ __forceinline__ void copy_tile(float* tile, const float* src, int stride) {
    constexpr int PER_ROW = WIDTH / 4, STEP = PREFILL_THREADS / PER_ROW;
    static_assert(PREFILL_THREADS % PER_ROW == 0 && STEP % 8 == 0 && ROWS % STEP == 0, "whole passes of 8k rows");
    const int r = threadIdx.x / PER_ROW, c = 4 * (threadIdx.x % PER_ROW);
    float* to = tile + at<WIDTH>(r, c);
    const float* from = src + (size_t)r * stride + c;
#pragma unroll
    for (int i = 0; i < ROWS / STEP; i++) cp_async16(to + i * STEP * WIDTH, from + (size_t)i * STEP * stride);
}

// The raw conv inputs of channel c for the chunk's tokens tok0 .. tok0 + CHUNK: those of the CONV_K - 1 tokens
// before it (from the ring before the call's first token), then its own (zero past t). The caller loads every
// input before it stores an output: an output stored to global memory might alias a later input for all the
// compiler knows, so interleaving them would leave one load at a time in flight (a trip to L2 a token).
__device__ __forceinline__ void conv_inputs(const float* proj, const float* ring, int c, int tok0, int t, int start,
                                            float (&x)[CONV_K - 1 + CHUNK]) {
#pragma unroll
    for (int j = 0; j < CONV_K - 1; j++) {
        const int tok = tok0 - (CONV_K - 1) + j;
        x[j] = tok >= 0 ? proj[(size_t)tok * PROJ_DIM + c] : ring[((start + tok + CONV_K) % CONV_K) * LIN_CONV_DIM + c];
    }
#pragma unroll
    for (int r = 0; r < CHUNK; r++) x[CONV_K - 1 + r] = tok0 + r < t ? proj[(size_t)(tok0 + r) * PROJ_DIM + c] : 0.f;
}

// The chunks kernel's SiLU and decays use the hardware's exp and division (a few ulp from expf and IEEE division):
// what they feed is rounded to tf32 (q, k, A, P, and v inside X) before any product.
__device__ __forceinline__ float silu_fast(float x) { return __fdividef(x, 1.f + __expf(-x)); }

// The causal conv + SiLU of one channel over `count` tokens whose raw inputs are staged in shared memory
// (in(r) for token r), `before` the raw inputs of the CONV_K - 1 tokens before the first: out(r, value) per token,
// zero from token `valid` on. A rolled loop: unrolled over the chunk, the conv's divisions alone would be enough
// code that a block's single pass through it waits on instruction fetch.
template <typename In, typename Out>
__device__ __forceinline__ void conv_staged(const float (&w)[CONV_K], float (&before)[CONV_K - 1], int count, int valid,
                                            In in, Out out) {
#pragma unroll 4
    for (int r = 0; r < count; r++) {
        const float xr = in(r);
        float acc = w[CONV_K - 1] * xr;
#pragma unroll
        for (int j = 0; j < CONV_K - 1; j++) acc += w[j] * before[j];
        float y = 0.f;
        if (r < valid) y = silu_fast(acc);
        out(r, y);
#pragma unroll
        for (int j = 0; j < CONV_K - 2; j++) before[j] = before[j + 1];
        before[CONV_K - 2] = xr;
    }
}

static_assert(CHUNK / 2 * PREFILL_THREADS <= 2 * CHUNK * CHUNK, "half a chunk of v inputs fits in kk and qk");

// Grid (chunks, LIN_K_HEADS), PREFILL_THREADS threads, deltanet_chunks_shared_bytes of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(PREFILL_THREADS, 2)
    deltanet_prefill_chunks(const float* proj, int t, int start, const float* ring, const float* conv_w,
                       const float* a_log, const float* dt_bias, float* q_out, float* k_out, float* v_out,
                       float* decay_out, float* beta_out, float* inverse_out, float* attn_out, int cut,
                       float* cut_ring, int cut2, float* cut_ring2) {
    wait_previous();
    extern __shared__ float4 chunks_shared[];
    float* qs = (float*)chunks_shared;  // [CHUNK][DK] q, then A of both value heads
    float* ks = qs + CHUNK * DK;        // [CHUNK][DK] k, then T of both value heads
    float* kk = ks + CHUNK * DK;        // [CHUNK][CHUNK] k k^T, then a [16][32] scratch per warp
    float* qk = kk + CHUNK * CHUNK;     // [CHUNK][CHUNK] q k^T
    float* a_tiles = qs;
    float* t_tiles = ks;
    __shared__ __align__(16) float decay[HEADS_PER_KEY][CHUNK];  // read 4 at a time below
    __shared__ float beta[HEADS_PER_KEY][CHUNK];
    __shared__ float first_half[HEADS_PER_KEY];
    const int chunk = blockIdx.x, chunks = gridDim.x, padded = chunks * CHUNK, key_head = blockIdx.y;
    const int tok0 = chunk * CHUNK;
    const int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP;

    // Conv + SiLU: thread tid takes q channel tid (tid < DK) or k channel tid - DK, then v channel tid % DV of
    // value head tid / DV of this key head.
    {
        float* dst = tid < DK ? qs : ks;
        const int i = tid % DK;
        const int c = (tid < DK ? 0 : LIN_K_DIM) + key_head * DK + i;
        const int head = key_head * HEADS_PER_KEY + tid / DV, j = tid % DV;
        float* v_dst = v_out + ((size_t)head * padded + tok0) * DV + j;
        // Both channels' inputs are loaded whole before anything is stored (see conv_inputs), q's or k's staged in
        // their tile and convolved there in place, then v's staged through kk and qk (free until k k^T) as
        // [CHUNK / 2][PREFILL_THREADS], half the chunk at a time, and written to v_out.
        const int cv = 2 * LIN_K_DIM + head * DV + j, valid = min(CHUNK, t - tok0);
        float w[CONV_K], wv[CONV_K], x[CONV_K - 1 + CHUNK], before[CONV_K - 1];
#pragma unroll
        for (int m = 0; m < CONV_K; m++) w[m] = conv_w[c * CONV_K + m], wv[m] = conv_w[cv * CONV_K + m];
        conv_inputs(proj, ring, c, tok0, t, start, x);
#pragma unroll
        for (int r = 0; r < CHUNK; r++) dst[at<DK>(r, i)] = x[CONV_K - 1 + r];
#pragma unroll
        for (int m = 0; m < CONV_K - 1; m++) before[m] = x[m];
        conv_inputs(proj, ring, cv, tok0, t, start, x);
        conv_staged(w, before, CHUNK, valid, [&](int r) { return dst[at<DK>(r, i)]; },
                    [&](int r, float y) { dst[at<DK>(r, i)] = y; });
        float* stage = kk + tid;
#pragma unroll
        for (int half = 0; half < 2; half++) {
            constexpr int HALF = CHUNK / 2;
#pragma unroll
            for (int r = 0; r < HALF; r++) stage[r * PREFILL_THREADS] = x[CONV_K - 1 + HALF * half + r];
#pragma unroll
            for (int m = 0; m < CONV_K - 1; m++) before[m] = x[HALF * half + m];
            conv_staged(wv, before, HALF, valid - HALF * half, [&](int r) { return stage[r * PREFILL_THREADS]; },
                        [&](int r, float y) { v_dst[(size_t)(HALF * half + r) * DV] = y; });
        }
        // The ring at a cut in this chunk: this thread's two channels' raw inputs of the tokens cut - CONV_K ..
        // cut - 1 at their slots, those before the call from the ring (read before the norm kernel rewrites it).
        // Loads first, then stores, as in the conv.
#pragma unroll 1
        for (int which = 0; which < 2; which++) {
            const int at = which == 0 ? cut : cut2;
            float* to = which == 0 ? cut_ring : cut_ring2;
            if (!(at > tok0 && at <= tok0 + CHUNK)) continue;
            const int channels[2] = {c, 2 * LIN_K_DIM + head * DV + j};
            float kept[CONV_K][2];
#pragma unroll
            for (int m = 0; m < CONV_K; m++) {
                const int tok = at - CONV_K + m, slot = (start + tok + CONV_K) % CONV_K;
#pragma unroll
                for (int n = 0; n < 2; n++)
                    kept[m][n] = tok >= 0 ? proj[(size_t)tok * PROJ_DIM + channels[n]]
                                          : ring[slot * LIN_CONV_DIM + channels[n]];
            }
#pragma unroll
            for (int m = 0; m < CONV_K; m++) {
                const int slot = (start + at - CONV_K + m + CONV_K) % CONV_K;
#pragma unroll
                for (int n = 0; n < 2; n++) to[slot * LIN_CONV_DIM + channels[n]] = kept[m][n];
            }
        }
    }
    // Gates (thread: value head tid / CHUNK, token tid % CHUNK) and their inclusive scan over the chunk: within
    // each warp's 32 tokens, then the first half's total added to the second.
    float cum = 0.f;
    if (tid < HEADS_PER_KEY * CHUNK) {
        const int hh = tid / CHUNK, r = tid % CHUNK, head = key_head * HEADS_PER_KEY + hh, tok = tok0 + r;
        float g = 0.f, b = 0.f;
        if (tok < t) {
            const float* gates = proj + (size_t)tok * PROJ_DIM + LIN_CONV_DIM + LIN_V_DIM;
            b = sigmoidf_(gates[head]);
            g = -expf(a_log[head]) * softplusf_(gates[LIN_V_HEADS + head] + dt_bias[head]);
        }
        cum = g;
#pragma unroll
        for (int o = 1; o < WARP; o <<= 1) {
            const float below = __shfl_up_sync(0xffffffffu, cum, o);
            if (lane >= o) cum += below;
        }
        if (r == WARP - 1) first_half[hh] = cum;
        beta[hh][r] = b;
        beta_out[(size_t)head * padded + tok] = b;
    }
    __syncthreads();
    if (tid < HEADS_PER_KEY * CHUNK) {
        const int hh = tid / CHUNK, r = tid % CHUNK, head = key_head * HEADS_PER_KEY + hh;
        if (r >= WARP) cum += first_half[hh];
        decay[hh][r] = cum;
        decay_out[(size_t)head * padded + tok0 + r] = cum;
    }
    // l2-norms of q and k, a warp per token; q also scaled by 1/sqrt(DK).
    for (int r = warp; r < CHUNK; r += PREFILL_WARPS) {
        constexpr int PER = DK / WARP;
        float qv[PER], kv[PER];
        float sq = 0.f, sk = 0.f;
#pragma unroll
        for (int m = 0; m < PER; m++) {
            qv[m] = qs[at<DK>(r, lane + WARP * m)];
            kv[m] = ks[at<DK>(r, lane + WARP * m)];
            sq += qv[m] * qv[m];
            sk += kv[m] * kv[m];
        }
        const float inv_q = 1.f / sqrtf(warp_sum(sq) + 1e-6f), inv_k = 1.f / sqrtf(warp_sum(sk) + 1e-6f);
        const size_t row = (size_t)key_head * padded + tok0 + r;
#pragma unroll
        for (int m = 0; m < PER; m++) {
            const int i = lane + WARP * m;
            const float qn = round_tf32(qv[m] * inv_q * (1.f / sqrtf((float)DK))), kn = round_tf32(kv[m] * inv_k);
            qs[at<DK>(r, i)] = qn;
            ks[at<DK>(r, i)] = kn;
            q_out[row * DK + i] = qn;
            k_out[row * DK + i] = kn;
        }
    }
    __syncthreads();

    // k k^T (warps 0-3) and q k^T (warps 4-7), a 16-row tile each.
    {
        const float* rows = warp < 4 ? ks : qs;
        float* dst = warp < 4 ? kk : qk;
        const int m0 = 16 * (warp % 4);
        float acc[CHUNK / 8][4] = {};
#pragma unroll 4
        for (int k0 = 0; k0 < DK; k0 += 8) {
            u32 a[4];
            load_a_ldsm<DK>(a, rows, m0, k0);
#pragma unroll
            for (int n = 0; n < CHUNK / 8; n += 2) {
                u32 b[4];
                load_b2_ldsm<DK, false>(b, ks, k0, 8 * n);
                mma_tf32(acc[n], a, {b[0], b[1]});
                mma_tf32(acc[n + 1], a, {b[2], b[3]});
            }
        }
        const int g = frag_g(), t2 = 2 * frag_t();
#pragma unroll
        for (int n = 0; n < CHUNK / 8; n++) {
            *(float2*)&dst[at<CHUNK>(m0 + g, 8 * n + t2)] = make_float2(acc[n][0], acc[n][1]);
            *(float2*)&dst[at<CHUNK>(m0 + g + 8, 8 * n + t2)] = make_float2(acc[n][2], acc[n][3]);
        }
    }
    __syncthreads();

    // A (into q's place) and P (to global) for both value heads; T cleared (into k's place). A thread takes 4
    // consecutive columns s0 .. s0 + 3 of a row (one 16-byte run of the swizzled tiles) at a time.
    for (int e = 4 * tid; e < HEADS_PER_KEY * CHUNK * CHUNK; e += 4 * PREFILL_THREADS) {
        const int hh = e / (CHUNK * CHUNK), r = (e / CHUNK) % CHUNK, s0 = e % CHUNK;
        const int head = key_head * HEADS_PER_KEY + hh, run = at<CHUNK>(r, s0);
        const float4 qk4 = *(const float4*)&qk[run], kk4 = *(const float4*)&kk[run];
        const float4 c4 = *(const float4*)&decay[hh][s0];
        const float qkv[4] = {qk4.x, qk4.y, qk4.z, qk4.w}, kkv[4] = {kk4.x, kk4.y, kk4.z, kk4.w};
        const float cs[4] = {c4.x, c4.y, c4.z, c4.w};
        const float cr = decay[hh][r], br = beta[hh][r];
        float a[4], p[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int s = s0 + i;
            const float between = __expf(cr - cs[i]);
            p[i] = s <= r ? round_tf32(qkv[i] * between) : 0.f;
            a[i] = s < r ? round_tf32(br * kkv[i] * between) : 0.f;
        }
        *(float4*)&a_tiles[hh * CHUNK * CHUNK + run] = make_float4(a[0], a[1], a[2], a[3]);
        *(float4*)&t_tiles[hh * CHUNK * CHUNK + run] = make_float4(0.f, 0.f, 0.f, 0.f);
        *(float4*)&attn_out[(((size_t)head * chunks + chunk) * CHUNK + r) * CHUNK + s0] =
            make_float4(p[0], p[1], p[2], p[3]);
    }
    __syncthreads();

    // T's 16 x 16 diagonal blocks by forward substitution: thread (value head, block, column j).
    if (tid < HEADS_PER_KEY * CHUNK) {
        const int hh = tid / CHUNK, d0 = 16 * ((tid / 16) % 4), j = tid % 16;
        const float* a = a_tiles + hh * CHUNK * CHUNK;
        float* inv = t_tiles + hh * CHUNK * CHUNK;
        float x[16];
#pragma unroll
        for (int r = 0; r < 16; r++) {
            float acc = r == j ? 1.f : 0.f;
#pragma unroll
            for (int s = 0; s < r; s++) acc -= a[at<CHUNK>(d0 + r, d0 + s)] * x[s];
            x[r] = acc;
        }
#pragma unroll
        for (int r = 0; r < 16; r++) inv[at<CHUNK>(d0 + r, d0 + j)] = round_tf32(x[r]);
    }
    __syncthreads();

    // The blocks below the diagonal, by distance from it: T_ij = -T_ii sum_{k=j}^{i-1} A_ik T_kj, a warp per
    // block (both heads: 6, 4, then 2 blocks), through the warp's scratch.
    float* scratch = kk + warp * 16 * 32;
    for (int dist = 1; dist < 4; dist++) {
        const int per_head = 4 - dist;
        if (warp < HEADS_PER_KEY * per_head) {
            const int hh = warp / per_head, bi = dist + warp % per_head, bj = bi - dist;
            const float* a = a_tiles + hh * CHUNK * CHUNK;
            float* inv = t_tiles + hh * CHUNK * CHUNK;
            float sum[2][4] = {};
            for (int k0 = 16 * bj; k0 < 16 * bi; k0 += 8) {
                u32 af[4];
                load_a_ldsm<CHUNK>(af, a, 16 * bi, k0);
#pragma unroll
                for (int n = 0; n < 2; n++) {
                    u32 bf[2];
                    load_b<CHUNK>(bf, inv, k0, 16 * bj + 8 * n);
                    mma_tf32(sum[n], af, bf);
                }
            }
#pragma unroll
            for (int n = 0; n < 2; n++) store_c<32>(scratch, 0, 8 * n, sum[n], 1.f);
            __syncwarp();
            float block[2][4] = {};
#pragma unroll
            for (int k0 = 0; k0 < 16; k0 += 8) {
                u32 af[4];
                load_a_ldsm<CHUNK>(af, inv, 16 * bi, 16 * bi + k0);
#pragma unroll
                for (int n = 0; n < 2; n++) {
                    u32 bf[2];
                    load_b<32>(bf, scratch, k0, 8 * n);
                    mma_tf32(block[n], af, bf);
                }
            }
#pragma unroll
            for (int n = 0; n < 2; n++) store_c<CHUNK>(inv, 16 * bi, 16 * bj + 8 * n, block[n], -1.f);
        }
        __syncthreads();
    }

    // T out, 4 consecutive columns (one 16-byte run of the swizzled tile) a thread at a time.
    for (int e = 4 * tid; e < HEADS_PER_KEY * CHUNK * CHUNK; e += 4 * PREFILL_THREADS) {
        const int hh = e / (CHUNK * CHUNK), r = (e / CHUNK) % CHUNK, s = e % CHUNK;
        const int head = key_head * HEADS_PER_KEY + hh;
        *(float4*)&inverse_out[(((size_t)head * chunks + chunk) * CHUNK + r) * CHUNK + s] =
            *(const float4*)&t_tiles[hh * CHUNK * CHUNK + at<CHUNK>(r, s)];
    }
}

// Grid (LIN_V_HEADS, STATE_SPLIT), PREFILL_THREADS threads, deltanet_state_shared_bytes of dynamic shared memory.
// state: f16 [LIN_V_HEADS][DK][DV], read and written. v_o: v in, o out (same layout).
//
// Warp roles per chunk: [q; k] S with warp w on rows 16 (w % 4) of q (w < 4) or k (w >= 4); warps 4-7 turn
// their k S rows into X, warps 0-3 keep e^c q S as the start of their o rows; T X on (16-row, 16-column) tiles;
// warps 0-3 add P V' to their o rows; each warp updates state rows 16 w .. 16 w + 15, which it holds throughout.
// In the chunk of a cut, the V' phase also keeps e^(c_p - c_s) V'_s for the rows s <= p before the cut (zero past
// it), and each warp writes its rows of S_p to cut_state (cut_state2 for the second cut) before the chunk's own
// update. The two cuts lie in different chunks.
extern "C" __global__ void __launch_bounds__(PREFILL_THREADS, 1)
    deltanet_prefill_state(const float* q, const float* k, float* v_o, const float* decay, const float* beta,
                      const float* inverse, const float* attn, int t, f16* state, int cut, f16* cut_state,
                      int cut2, f16* cut_state2) {
    wait_previous();
    extern __shared__ float4 state_shared[];
    float* qs = (float*)state_shared;   // [CHUNK][DK]
    float* ks = qs + CHUNK * DK;        // [2][CHUNK][DK], by chunk parity
    float* ts = ks + 2 * CHUNK * DK;    // [CHUNK][CHUNK] T
    float* ps = ts + CHUNK * CHUNK;     // [CHUNK][CHUNK] P
    float* vs = ps + CHUNK * CHUNK;     // [CHUNK][COLS] v
    // The operands read as B are kept transposed (at_t), so that ldmatrix reads them.
    float* xs = vs + CHUNK * COLS;      // [COLS][CHUNK] X^T
    float* vps = xs + CHUNK * COLS;     // [COLS][CHUNK] V'^T
    float* vds = vps + CHUNK * COLS;    // [COLS][CHUNK] (e^(c_last - c_s) V'_s)^T
    float* vcs = vds + CHUNK * COLS;    // [COLS][CHUNK] (e^(c_p - c_s) V'_s)^T up to a cut's row p, zero after
    float* ss = vcs + CHUNK * COLS;     // [COLS][DK] S^T, tf32
    float* decay_s = ss + DK * COLS;    // [2][CHUNK] c, by chunk parity
    float* beta_s = decay_s + 2 * CHUNK;  // [2][CHUNK] beta, by chunk parity
    const int chunks = (t + CHUNK - 1) / CHUNK, padded = chunks * CHUNK;
    const int head = blockIdx.x, key_head = head / HEADS_PER_KEY, col0 = blockIdx.y * COLS;
    const int tid = threadIdx.x, warp = tid / WARP, g = frag_g(), t2 = 2 * frag_t();
    const float* q_head = q + (size_t)key_head * padded * DK;
    const float* k_head = k + (size_t)key_head * padded * DK;
    float* v_head = v_o + (size_t)head * padded * DV;
    const float* decay_head = decay + (size_t)head * padded;
    const float* beta_head = beta + (size_t)head * padded;
    const float* inverse_head = inverse + (size_t)head * chunks * CHUNK * CHUNK;
    const float* attn_head = attn + (size_t)head * chunks * CHUNK * CHUNK;

    // Every chunk issues the same five groups, each right after the barrier that follows its buffer's last reader:
    // q (after [q; k] S), v with c and beta (after X), T (after T X), P and k of the chunk after next (after the
    // state update). A step waits for its own copies of the group it needs, then the barrier makes every thread's
    // copies visible: the chunk's q and k are the fifth newest group at its start (cp_async_wait<4>), v, T and P
    // the fourth newest at their steps (cp_async_wait<3>).
    auto load_q = [&](int n) {
        if (n < chunks) copy_tile<CHUNK, DK>(qs, q_head + (size_t)n * CHUNK * DK, DK);
        cp_async_commit();
    };
    auto load_k = [&](int n) {
        if (n < chunks) copy_tile<CHUNK, DK>(ks + (n & 1) * CHUNK * DK, k_head + (size_t)n * CHUNK * DK, DK);
        cp_async_commit();
    };
    auto load_v = [&](int n) {
        if (n < chunks) {
            copy_tile<CHUNK, COLS>(vs, v_head + (size_t)n * CHUNK * DV + col0, DV);
            if (tid < CHUNK / 4) cp_async16(decay_s + (n & 1) * CHUNK + 4 * tid, decay_head + n * CHUNK + 4 * tid);
            else if (tid < CHUNK / 2) cp_async16(beta_s + (n & 1) * CHUNK + 4 * tid - CHUNK, beta_head + n * CHUNK + 4 * tid - CHUNK);
        }
        cp_async_commit();
    };
    auto load_t = [&](int n) {
        if (n < chunks) copy_tile<CHUNK, CHUNK>(ts, inverse_head + (size_t)n * CHUNK * CHUNK, CHUNK);
        cp_async_commit();
    };
    auto load_p = [&](int n) {
        if (n < chunks) copy_tile<CHUNK, CHUNK>(ps, attn_head + (size_t)n * CHUNK * CHUNK, CHUNK);
        cp_async_commit();
    };

    // This warp's state rows 16 warp + (g, g + 8), columns col0 + 8 n + (t2, t2 + 1).
    float s_rows[COLS / 8][4];
    f16* state_block = state + (size_t)head * DK * DV + col0;
#pragma unroll
    for (int n = 0; n < COLS / 8; n++) {
        const float2 lo = f16x2_to_float2(*(const u32*)&state_block[(16 * warp + g) * DV + 8 * n + t2]);
        const float2 hi = f16x2_to_float2(*(const u32*)&state_block[(16 * warp + g + 8) * DV + 8 * n + t2]);
        s_rows[n][0] = lo.x;
        s_rows[n][1] = lo.y;
        s_rows[n][2] = hi.x;
        s_rows[n][3] = hi.y;
        store_c_transposed<DK>(ss, 16 * warp, 8 * n, s_rows[n], 1.f);
    }
    load_k(0);
    load_q(0);
    load_v(0);
    load_t(0);
    load_p(0);
    load_k(1);

    const int m0 = 16 * (warp % 4);
    for (int n = 0; n < chunks; n++) {
        const float* kt = ks + (n & 1) * CHUNK * DK;
        const float* c = decay_s + (n & 1) * CHUNK;
        const float* bt = beta_s + (n & 1) * CHUNK;
        // The rows of a cut in this chunk (1 .. CHUNK when one falls in it; the same for the whole block).
        const int first_rows = cut - n * CHUNK, second_rows = cut2 - n * CHUNK;
        const bool first_here = first_rows >= 1 && first_rows <= CHUNK;
        const int cut_rows = first_here ? first_rows : second_rows;
        const bool cut_here = cut_rows >= 1 && cut_rows <= CHUNK;
        cp_async_wait<4>();
        __syncthreads();

        // [q; k] S.
        float acc[COLS / 8][4] = {};
        {
            const float* rows = warp < 4 ? qs : kt;
#pragma unroll 4
            for (int k0 = 0; k0 < DK; k0 += 8) {
                u32 a[4];
                load_a_ldsm<DK>(a, rows, m0, k0);
#pragma unroll
                for (int j = 0; j < COLS / 8; j += 2) {
                    u32 b[4];
                    load_b2_ldsm<DK, true>(b, ss, k0, 8 * j);
                    mma_tf32(acc[j], a, {b[0], b[1]});
                    mma_tf32(acc[j + 1], a, {b[2], b[3]});
                }
            }
        }
        cp_async_wait<3>();
        __syncthreads();
        load_q(n + 1);

        // o starts as e^c q S; X = beta (v - e^c k S).
        {
            const int r0 = m0 + g, r1 = r0 + 8;
            const float e0 = expf(c[r0]), e1 = expf(c[r1]);
            if (warp < 4) {
#pragma unroll
                for (int j = 0; j < COLS / 8; j++) {
                    acc[j][0] *= e0;
                    acc[j][1] *= e0;
                    acc[j][2] *= e1;
                    acc[j][3] *= e1;
                }
            } else {
                const float b0 = bt[r0], b1 = bt[r1];
#pragma unroll
                for (int j = 0; j < COLS / 8; j++) {
                    const float2 v0 = *(const float2*)&vs[at<COLS>(r0, 8 * j + t2)];
                    const float2 v1 = *(const float2*)&vs[at<COLS>(r1, 8 * j + t2)];
                    xs[at_t<CHUNK>(8 * j + t2, r0)] = round_tf32(b0 * (v0.x - e0 * acc[j][0]));
                    xs[at_t<CHUNK>(8 * j + t2 + 1, r0)] = round_tf32(b0 * (v0.y - e0 * acc[j][1]));
                    xs[at_t<CHUNK>(8 * j + t2, r1)] = round_tf32(b1 * (v1.x - e1 * acc[j][2]));
                    xs[at_t<CHUNK>(8 * j + t2 + 1, r1)] = round_tf32(b1 * (v1.y - e1 * acc[j][3]));
                }
            }
        }
        cp_async_wait<3>();
        __syncthreads();
        load_v(n + 1);

        // V' = T X: warp w on rows 16 (w % 4), columns 16 (w / 4); T is lower triangular, so only the column
        // blocks up to the diagonal count.
        {
            const int n0 = 16 * (warp / 4);
            float vacc[2][4] = {};
            for (int k0 = 0; k0 < m0 + 16; k0 += 8) {
                u32 a[4], b[4];
                load_a_ldsm<CHUNK>(a, ts, m0, k0);
                load_b2_ldsm<CHUNK, true>(b, xs, k0, n0);
                mma_tf32(vacc[0], a, {b[0], b[1]});
                mma_tf32(vacc[1], a, {b[2], b[3]});
            }
            const float last = c[CHUNK - 1];
            const float w0 = expf(last - c[m0 + g]), w1 = expf(last - c[m0 + g + 8]);
#pragma unroll
            for (int j = 0; j < 2; j++) {
                store_c_transposed<CHUNK>(vps, m0, n0 + 8 * j, vacc[j], 1.f);
                const float scaled[4] = {vacc[j][0] * w0, vacc[j][1] * w0, vacc[j][2] * w1, vacc[j][3] * w1};
                store_c_transposed<CHUNK>(vds, m0, n0 + 8 * j, scaled, 1.f);
            }
            if (cut_here) {
                const float at_cut = c[cut_rows - 1];
                const int r0 = m0 + g, r1 = r0 + 8;
                const float u0 = r0 < cut_rows ? expf(at_cut - c[r0]) : 0.f;
                const float u1 = r1 < cut_rows ? expf(at_cut - c[r1]) : 0.f;
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    const float scaled[4] = {vacc[j][0] * u0, vacc[j][1] * u0, vacc[j][2] * u1, vacc[j][3] * u1};
                    store_c_transposed<CHUNK>(vcs, m0, n0 + 8 * j, scaled, 1.f);
                }
            }
        }
        cp_async_wait<3>();
        __syncthreads();
        load_t(n + 1);

        // o += P V' (warps 0-3), written over v's rows of this chunk.
        if (warp < 4) {
            for (int k0 = 0; k0 < m0 + 16; k0 += 8) {
                u32 a[4];
                load_a_ldsm<CHUNK>(a, ps, m0, k0);
#pragma unroll
                for (int j = 0; j < COLS / 8; j += 2) {
                    u32 b[4];
                    load_b2_ldsm<CHUNK, true>(b, vps, k0, 8 * j);
                    mma_tf32(acc[j], a, {b[0], b[1]});
                    mma_tf32(acc[j + 1], a, {b[2], b[3]});
                }
            }
            const int tok = n * CHUNK + m0 + g;
#pragma unroll
            for (int j = 0; j < COLS / 8; j++) {
                if (tok < t) *(float2*)&v_head[(size_t)tok * DV + col0 + 8 * j + t2] = make_float2(acc[j][0], acc[j][1]);
                if (tok + 8 < t)
                    *(float2*)&v_head[(size_t)(tok + 8) * DV + col0 + 8 * j + t2] = make_float2(acc[j][2], acc[j][3]);
            }
        }
        // S_p at a cut in this chunk: e^(c_p) S + k^T (e^(c_p - c) V'), rows past p zero.
        if (cut_here) {
            const float keep = expf(c[cut_rows - 1]);
            float at_cut[COLS / 8][4];
#pragma unroll
            for (int j = 0; j < COLS / 8; j++)
#pragma unroll
                for (int i = 0; i < 4; i++) at_cut[j][i] = s_rows[j][i] * keep;
#pragma unroll 2
            for (int k0 = 0; k0 < CHUNK; k0 += 8) {
                u32 a[4];
                load_a_transposed<DK>(a, kt, 16 * warp, k0);
#pragma unroll
                for (int j = 0; j < COLS / 8; j += 2) {
                    u32 b[4];
                    load_b2_ldsm<CHUNK, true>(b, vcs, k0, 8 * j);
                    mma_tf32(at_cut[j], a, {b[0], b[1]});
                    mma_tf32(at_cut[j + 1], a, {b[2], b[3]});
                }
            }
            f16* cut_block = (first_here ? cut_state : cut_state2) + (size_t)head * DK * DV + col0;
#pragma unroll
            for (int j = 0; j < COLS / 8; j++) {
                *(u32*)&cut_block[(16 * warp + g) * DV + 8 * j + t2] = float2_to_f16x2(at_cut[j][0], at_cut[j][1]);
                *(u32*)&cut_block[(16 * warp + g + 8) * DV + 8 * j + t2] = float2_to_f16x2(at_cut[j][2], at_cut[j][3]);
            }
        }
        // S <- e^(c_last) S + k^T (e^(c_last - c) V').
        {
            const float chunk_decay = expf(c[CHUNK - 1]);
#pragma unroll
            for (int j = 0; j < COLS / 8; j++)
#pragma unroll
                for (int i = 0; i < 4; i++) s_rows[j][i] *= chunk_decay;
#pragma unroll 4
            for (int k0 = 0; k0 < CHUNK; k0 += 8) {
                u32 a[4];
                load_a_transposed<DK>(a, kt, 16 * warp, k0);
#pragma unroll
                for (int j = 0; j < COLS / 8; j += 2) {
                    u32 b[4];
                    load_b2_ldsm<CHUNK, true>(b, vds, k0, 8 * j);
                    mma_tf32(s_rows[j], a, {b[0], b[1]});
                    mma_tf32(s_rows[j + 1], a, {b[2], b[3]});
                }
            }
#pragma unroll
            for (int j = 0; j < COLS / 8; j++) store_c_transposed<DK>(ss, 16 * warp, 8 * j, s_rows[j], 1.f);
        }
        __syncthreads();
        load_p(n + 1);
        load_k(n + 2);
    }
    cp_async_wait<0>();

#pragma unroll
    for (int n = 0; n < COLS / 8; n++) {
        *(u32*)&state_block[(16 * warp + g) * DV + 8 * n + t2] = float2_to_f16x2(s_rows[n][0], s_rows[n][1]);
        *(u32*)&state_block[(16 * warp + g + 8) * DV + 8 * n + t2] = float2_to_f16x2(s_rows[n][2], s_rows[n][3]);
    }
}

// ---- Short calls: the recurrence token by token ----
// A call of at most SHORT_MAX_TOKENS tokens (a short prompt, the few tokens after a cached prefix or between two
// snapshot cuts) costs the chunked form a chunks block per key head whose conv, norms and inversion of I + A take as
// long for 3 tokens as for 64, then the state pass: more than the recurrence itself. deltanet_prefill_short runs the
// decode step's arithmetic (kernels/deltanet.cu) token by token instead, and leaves o in v_o as the state pass would,
// for deltanet_prefill_norm. Grid (value heads, SHORT_SPLIT), PREFILL_THREADS threads: a block owns SHORT_COLS state
// columns of one value head, held in registers (a warp 4 columns, a lane 4 rows of them). It first computes, for
// every token at once, the conv + SiLU of its key head's q and k (thread c takes channel c of [q; k]) and of its
// value columns, the l2-norms and the gates, into shared memory; then, per token, two warp reductions: k . S (for
// u = beta (v - k S)) and q . S after the update. A token costs no block barrier: the warps run their columns'
// recurrences side by side. The conv's taps come from the call's own proj rows or, before its
// first token, from the ring, which this kernel only reads (deltanet_prefill_norm updates it). At `cut` (tokens
// into the call, 0 for none) the state goes to cut_state and the ring as those tokens leave it to cut_ring (the
// blocks that own a channel write it: a key head's q and k by its first value head's first block, the value columns
// by their block); the same at `cut2`.
// DELTANET_SHORT=0 leaves every call to the chunked form (the host reads a limit of 0).
#ifndef DELTANET_SHORT
#define DELTANET_SHORT 1
#endif
#ifndef SHORT_MAX_TOKENS
#define SHORT_MAX_TOKENS 32
#endif
#define SHORT_SPLIT 4
#define SHORT_COLS (DV / SHORT_SPLIT)
extern "C" __device__ const int deltanet_short_max_tokens = DELTANET_SHORT ? SHORT_MAX_TOKENS : 0;
extern "C" __device__ const int deltanet_short_split = SHORT_SPLIT;

// The conv input of channel c at position start + i - back (back 0 .. CONV_K - 1): the call's proj row, or for a
// position before the call the ring's slot of it.
__device__ __forceinline__ float conv_input(const float* proj, const float* ring, int start, int i, int back, int c) {
    const int at = i - back;
    return at >= 0 ? proj[(size_t)at * PROJ_DIM + c] : ring[((start + at + CONV_K) % CONV_K) * LIN_CONV_DIM + c];
}

// SiLU of the causal conv of channel c (weights w) at token i, in ConvTaps::silu_conv's order (kernels/deltanet.cu).
__device__ __forceinline__ float conv_silu(const float* proj, const float* ring, const float (&w)[CONV_K], int start,
                                           int i, int c) {
    float acc = w[CONV_K - 1] * conv_input(proj, ring, start, i, 0, c);
#pragma unroll
    for (int j = 0; j < CONV_K - 1; j++) acc += w[j] * conv_input(proj, ring, start, i, CONV_K - 1 - j, c);
    return siluf_(acc);
}

// The ring of channel c as the call's first `tokens` tokens leave it, into `to` (the slots of the last CONV_K
// positions before start + tokens).
__device__ __forceinline__ void ring_after(const float* proj, const float* ring, int start, int tokens, int c,
                                           float* to) {
#pragma unroll
    for (int back = 0; back < CONV_K; back++) {
        const int i = tokens - 1 - back;
        to[((start + i + CONV_K) % CONV_K) * LIN_CONV_DIM + c] = conv_input(proj, ring, start, i, 0, c);
    }
}

extern "C" __global__ void __launch_bounds__(PREFILL_THREADS)
    deltanet_prefill_short(const float* proj, int t, int start, const float* ring, const float* conv_w,
                           const float* a_log, const float* dt_bias, float* v_o, f16* state, int cut,
                           f16* cut_state, float* cut_ring, int cut2, f16* cut_state2, float* cut_ring2) {
    constexpr int WARP_COLS = SHORT_COLS / PREFILL_WARPS, LANE_ROWS = DK / WARP;
    constexpr int V_STEP = PREFILL_THREADS / SHORT_COLS, RAW = SHORT_MAX_TOKENS + CONV_K - 1;
    static_assert(2 * DK == PREFILL_THREADS && WARP_COLS == 4 && LANE_ROWS == 4, "a thread a channel of [q; k]; "
                  "a warp 4 state columns, a lane 4 rows of them");
    static_assert(SHORT_MAX_TOKENS % V_STEP == 0, "whole rounds of the threads take the value columns' tokens");
    __shared__ __align__(16) float qk[SHORT_MAX_TOKENS][2 * DK];
    __shared__ __align__(16) float v[SHORT_MAX_TOKENS][SHORT_COLS];
    __shared__ float beta_s[SHORT_MAX_TOKENS], decay_s[SHORT_MAX_TOKENS];
    if (t > SHORT_MAX_TOKENS) __trap();  // the host takes the chunked form past SHORT_MAX_TOKENS

    const int head = blockIdx.x, key_head = head / HEADS_PER_KEY, col0 = blockIdx.y * SHORT_COLS;
    const int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP;
    const float a_log_h = a_log[head], dt_bias_h = dt_bias[head];
    // Thread tid's channel of [q; k] and value column, and their conv weights.
    const int c_qk = tid < DK ? key_head * DK + tid : LIN_K_DIM + key_head * DK + (tid - DK);
    const int vc = tid % SHORT_COLS, c_v = 2 * LIN_K_DIM + head * DV + col0 + vc;
    float w_qk[CONV_K], w_v[CONV_K];
#pragma unroll
    for (int j = 0; j < CONV_K; j++) w_qk[j] = conv_w[c_qk * CONV_K + j], w_v[j] = conv_w[c_v * CONV_K + j];
    wait_previous();

    // Every token's conv + SiLU of [q; k] (thread tid: channel tid). The channel's inputs at positions start - 3 ..
    // start + t - 1 are read first, all at once (raw[p] is position start + p - (CONV_K - 1)), so the reads wait
    // for memory once rather than once a token; the sums are conv_silu's, in its order.
    {
        float raw[RAW];
#pragma unroll
        for (int p = 0; p < RAW; p++) {
            const int i = p - (CONV_K - 1);
            raw[p] = i < t ? conv_input(proj, ring, start, i, 0, c_qk) : 0.f;
        }
#pragma unroll
        for (int i = 0; i < SHORT_MAX_TOKENS; i++) {
            if (i >= t) break;
            float acc = w_qk[CONV_K - 1] * raw[i + CONV_K - 1];
#pragma unroll
            for (int j = 0; j < CONV_K - 1; j++) acc += w_qk[j] * raw[i + j];
            qk[i][tid] = siluf_(acc);
        }
    }
    // The block's value columns: column vc of tokens tid / SHORT_COLS, + V_STEP, ..., each read in one go.
#pragma unroll
    for (int m = 0; m < SHORT_MAX_TOKENS / V_STEP; m++) {
        const int i = tid / SHORT_COLS + m * V_STEP;
        if (i < t) v[i][vc] = conv_silu(proj, ring, w_v, start, i, c_v);
    }
    for (int i = tid; i < t; i += PREFILL_THREADS) {
        const float* row = proj + (size_t)i * PROJ_DIM + LIN_CONV_DIM + LIN_V_DIM;
        beta_s[i] = sigmoidf_(row[head]);
        decay_s[i] = expf(-expf(a_log_h) * softplusf_(row[LIN_V_HEADS + head] + dt_bias_h));
    }
    // The ring at the cuts, by the blocks that own each channel.
    const bool owns_qk = blockIdx.y == 0 && head % HEADS_PER_KEY == 0;
    if (cut > 0) {
        if (owns_qk) ring_after(proj, ring, start, cut, c_qk, cut_ring);
        if (tid < SHORT_COLS) ring_after(proj, ring, start, cut, c_v, cut_ring);
    }
    if (cut2 > 0) {
        if (owns_qk) ring_after(proj, ring, start, cut2, c_qk, cut_ring2);
        if (tid < SHORT_COLS) ring_after(proj, ring, start, cut2, c_v, cut_ring2);
    }
    __syncthreads();
    // The l2-norms of each token's q and k (warp w: tokens w, w + 8, ...), q also scaled by 1 / sqrt(DK).
    for (int i = warp; i < t; i += PREFILL_WARPS) {
#pragma unroll
        for (int part = 0; part < 2; part++) {
            float* x = &qk[i][part * DK + 4 * lane];
            const float sq = warp_sum(x[0] * x[0] + x[1] * x[1] + x[2] * x[2] + x[3] * x[3]);
            const float scale = 1.f / sqrtf(sq + 1e-6f) * (part == 0 ? 1.f / sqrtf((float)DK) : 1.f);
#pragma unroll
            for (int e = 0; e < 4; e++) x[e] *= scale;
        }
    }

    // Warp w owns the state's columns col0 + 4 w .. + 3, lane l their rows 4 l .. 4 l + 3 (s[r][c], f32), so a
    // token's sums over the rows are warp reductions and the warps never wait for each other.
    const int i0 = LANE_ROWS * lane, wc = WARP_COLS * warp;
    const size_t at = (size_t)head * DK * DV + col0 + wc;
    float s[LANE_ROWS][WARP_COLS];
#pragma unroll
    for (int r = 0; r < LANE_ROWS; r++) {
        const uint2 h = *(const uint2*)&state[at + (size_t)(i0 + r) * DV];
        const float2 a = f16x2_to_float2(h.x), b = f16x2_to_float2(h.y);
        s[r][0] = a.x, s[r][1] = a.y, s[r][2] = b.x, s[r][3] = b.y;
    }
    auto store_state = [&](f16* to) {
#pragma unroll
        for (int r = 0; r < LANE_ROWS; r++)
            *(uint2*)&to[at + (size_t)(i0 + r) * DV] =
                make_uint2(float2_to_f16x2(s[r][0], s[r][1]), float2_to_f16x2(s[r][2], s[r][3]));
    };
    // Each column's sum over the warp's lanes, in every lane.
    auto warp_sums = [](float (&x)[WARP_COLS]) {
#pragma unroll
        for (int o = WARP / 2; o > 0; o >>= 1)
#pragma unroll
            for (int c = 0; c < WARP_COLS; c++) x[c] += __shfl_xor_sync(0xffffffffu, x[c], o);
    };
    __syncthreads();  // the norms are done

    const int padded = (t + CHUNK - 1) / CHUNK * CHUNK;
    for (int i = 0; i < t; i++) {
        const float decay = decay_s[i], beta = beta_s[i];
        const float4 q4 = *(const float4*)&qk[i][i0], k4 = *(const float4*)&qk[i][DK + i0];
        const float4 v4 = *(const float4*)&v[i][wc];
        const float q[LANE_ROWS] = {q4.x, q4.y, q4.z, q4.w}, k[LANE_ROWS] = {k4.x, k4.y, k4.z, k4.w};
        const float vi[WARP_COLS] = {v4.x, v4.y, v4.z, v4.w};
        float kv[WARP_COLS], o[WARP_COLS];
#pragma unroll
        for (int c = 0; c < WARP_COLS; c++) {
            kv[c] = 0.f;
#pragma unroll
            for (int r = 0; r < LANE_ROWS; r++) {
                s[r][c] *= decay;
                kv[c] = fmaf(s[r][c], k[r], kv[c]);
            }
        }
        warp_sums(kv);
#pragma unroll
        for (int c = 0; c < WARP_COLS; c++) {
            const float u = (vi[c] - kv[c]) * beta;
            o[c] = 0.f;
#pragma unroll
            for (int r = 0; r < LANE_ROWS; r++) {
                s[r][c] = fmaf(k[r], u, s[r][c]);
                o[c] = fmaf(s[r][c], q[r], o[c]);
            }
        }
        warp_sums(o);
        if (lane == 0) *(float4*)&v_o[((size_t)head * padded + i) * DV + col0 + wc] = make_float4(o[0], o[1], o[2], o[3]);
        if (i + 1 == cut) store_state(cut_state);
        if (i + 1 == cut2) store_state(cut_state2);
    }
    store_state(state);
}

// Grid (ceil(t * LIN_V_HEADS / PREFILL_WARPS)), PREFILL_THREADS threads: a warp per (token, value head),
// out[token][head * DV + j] = bf16(norm_w[j] * rmsnorm(o)[j] * silu(z[j])) as out_proj_deltanet computes it; where
// `codes.codes` is not null, the rows also as the Q8x2 codes that out_proj's integer small tiling reads (what
// gemm_quantize_rows would make of them), so that product needs no launch to code them. Then the ring gets the raw
// conv inputs of the call's last min(t, CONV_K) tokens at their slots, as decode leaves it.
extern "C" __global__ void __launch_bounds__(PREFILL_THREADS)
    deltanet_prefill_norm(const float* o, const float* proj, const float* norm_w, int t, int start, float* ring,
                     bf16* out, Q8x2 codes) {
    wait_previous();
    static_assert(DV == 4 * WARP && PROJ_DIM % 4 == 0, "a lane takes 4 columns, 16-byte aligned");
    static_assert(DV % GROUP == 0, "a head's columns are whole groups of the codes");
    const int padded = (t + CHUNK - 1) / CHUNK * CHUNK;
    const int lane = threadIdx.x % WARP;
    const int item = blockIdx.x * PREFILL_WARPS + threadIdx.x / WARP;
    if (item < t * LIN_V_HEADS) {
        const int tok = item / LIN_V_HEADS, head = item % LIN_V_HEADS;
        const float4 x = *(const float4*)&o[((size_t)head * padded + tok) * DV + 4 * lane];
        const float4 z = *(const float4*)&proj[(size_t)tok * PROJ_DIM + LIN_CONV_DIM + head * DV + 4 * lane];
        const float4 w = *(const float4*)&norm_w[4 * lane];
        const float inv = 1.f / sqrtf(warp_sum(x.x * x.x + x.y * x.y + x.z * x.z + x.w * x.w) / DV + RMS_EPS);
        const bf16 y0 = float_to_bf16(x.x * (inv * w.x) * siluf_(z.x)), y1 = float_to_bf16(x.y * (inv * w.y) * siluf_(z.y));
        const bf16 y2 = float_to_bf16(x.z * (inv * w.z) * siluf_(z.z)), y3 = float_to_bf16(x.w * (inv * w.w) * siluf_(z.w));
        *(uint2*)&out[(size_t)tok * LIN_V_DIM + head * DV + 4 * lane] =
            make_uint2((u32)y0 | (u32)y1 << 16, (u32)y2 | (u32)y3 << 16);
        if (codes.codes) {
            // A word of the codes (8 inputs) is two lanes' values: both lanes of a pair hold it whole, and the even
            // lane writes it.
            const float mine[4] = {bf16_to_float(y0), bf16_to_float(y1), bf16_to_float(y2), bf16_to_float(y3)};
            float v[8];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const float theirs = __shfl_xor_sync(0xffffffffu, mine[i], 1);
                v[i] = lane & 1 ? theirs : mine[i];
                v[4 + i] = lane & 1 ? mine[i] : theirs;
            }
            const size_t word = (size_t)tok * (LIN_V_DIM / 8) + head * (DV / 8) + lane / 2;
            const size_t pair = (size_t)tok * (LIN_V_DIM / GROUP) + head * (DV / GROUP) + lane / 16;
            quantize_word_q8x2<2>(v, (lane % 16) / 2, lane % 2 == 0, (uint4*)codes.codes + word,
                                  (float2*)codes.pairs + pair);
        }
    }
    const int kept = t < CONV_K ? t : CONV_K;
    for (int e = blockIdx.x * PREFILL_THREADS + threadIdx.x; e < kept * LIN_CONV_DIM; e += gridDim.x * PREFILL_THREADS) {
        const int tok = t - kept + e / LIN_CONV_DIM, c = e % LIN_CONV_DIM;
        ring[((start + tok) % CONV_K) * LIN_CONV_DIM + c] = proj[(size_t)tok * PROJ_DIM + c];
    }
}
