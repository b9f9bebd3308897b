// Prefill glue around the matrix products (gemm.cu): the chunk's embedding rows, RMSNorm rows into the bf16 input
// of the next product, the router's logits for few tokens, every token's routing, a stable counting sort of the
// (token, slot) entries by expert with the tile list of the grouped expert products, and the MoE's combine into
// the residual stream (on its own, or inside the next RMSNorm).

#define ROW_THREADS 256
#define SORT_THREADS 256

// Column c of row r's MoE output: the sum over its slots of expert_out[r * MOE_SLOTS + slot] (each already
// weighted; the shared expert's last), in slot order.
__device__ __forceinline__ float combined_experts(const float* expert_out, size_t r, int c) {
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < MOE_SLOTS; k++) s += expert_out[(r * MOE_SLOTS + k) * HIDDEN + c];
    return s;
}

// hidden[r] = the dequantized embedding row of tokens[start + r]. Grid (t).
extern "C" __global__ void __launch_bounds__(ROW_THREADS) embed_rows(const int* tokens, int start, Q4 table,
                                                                    float* hidden) {
    wait_previous();
    const int token = tokens[start + blockIdx.x];
    float* out = hidden + (size_t)blockIdx.x * HIDDEN;
    for (int c = threadIdx.x; c < HIDDEN; c += ROW_THREADS) {
        const u32 word = table.packed[(size_t)token * (HIDDEN / 8) + c / 8];
        const float2 f = pair_to_float2(table.scale_bias[(size_t)token * (HIDDEN / GROUP) + c / GROUP]);
        out[c] = f.x * nibble_to_float(word, 4 * (c % 8)) + f.y;
    }
}

// out[r] = bf16(rmsnorm(hidden[r]) * norm), and where `out_lo` is not null what that rounding lost, also in bf16
// (the router's products take both: routing is decided by small differences between logits). Where `expert_out`
// is not null, the previous MoE block's expert rows are first added to hidden[r] and written back, exactly as
// moe_combine adds them: the residual stream's update and the next norm in one launch. Where `codes.codes` is not
// null, row r of out (+ out_lo) is also coded as Q8x2 into `codes`, as gemm_quantize_rows or moe_quantize_rows
// would code it: the input of the integer small tiling without a launch of its own. Grid (t).
extern "C" __global__ void __launch_bounds__(ROW_THREADS) rmsnorm_rows(float* hidden, const float* expert_out,
                                                                      const float* norm, bf16* out, bf16* out_lo,
                                                                      Q8x2 codes) {
    wait_previous();
    constexpr int PER = (HIDDEN + ROW_THREADS - 1) / ROW_THREADS;
    __shared__ float scratch[32];
    // The row's rounded values, hi + lo, for the coding: a thread then takes 8 consecutive inputs (a Q8x2 word).
    __shared__ __align__(16) float rounded[HIDDEN];
    const size_t r = blockIdx.x;
    float* h = hidden + r * HIDDEN;
    float v[PER];
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < PER; i++) {
        const int c = threadIdx.x + i * ROW_THREADS;
        v[i] = c < HIDDEN ? h[c] : 0.f;
        if (expert_out && c < HIDDEN) {
            v[i] += combined_experts(expert_out, r, c);
            h[c] = v[i];
        }
        s += v[i] * v[i];
    }
    const float inv = 1.f / sqrtf(block_sum(s, scratch) / HIDDEN + RMS_EPS);
#pragma unroll
    for (int i = 0; i < PER; i++) {
        const int c = threadIdx.x + i * ROW_THREADS;
        if (c >= HIDDEN) continue;
        const float x = v[i] * inv * norm[c];
        const bf16 hi = float_to_bf16(x);
        out[(size_t)blockIdx.x * HIDDEN + c] = hi;
        const bf16 lo = float_to_bf16(x - bf16_to_float(hi));
        if (out_lo) out_lo[(size_t)blockIdx.x * HIDDEN + c] = lo;
        // The sum the separate coding kernels form from the stored rows (lo is 0 where it is not stored).
        rounded[c] = bf16_to_float(hi) + (out_lo ? bf16_to_float(lo) : 0.f);
    }
    if (!codes.codes) return;  // uniform over the block
    __syncthreads();
    constexpr int WORDS = HIDDEN / 8;
    static_assert(HIDDEN % GROUP == 0, "whole groups of inputs");
#pragma unroll
    for (int w0 = 0; w0 < WORDS; w0 += ROW_THREADS) {
        const int w = w0 + threadIdx.x;
        const bool valid = w < WORDS;  // every lane takes part in the group's shuffles
        float x[8];
        const float4 a = valid ? *(const float4*)&rounded[8 * w] : make_float4(0.f, 0.f, 0.f, 0.f);
        const float4 b = valid ? *(const float4*)&rounded[8 * w + 4] : make_float4(0.f, 0.f, 0.f, 0.f);
        x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
        quantize_word_q8x2(x, w % 8, valid, (uint4*)codes.codes + r * WORDS + w,
                           (float2*)codes.pairs + r * (HIDDEN / GROUP) + w / 8);
    }
}

// ---- The router's logits for few rows (a batched decode step, a short prompt), on the CUDA cores in f32 ----
// logits[t][e] = router[e] . x[t] for the NUM_EXPERTS + 1 router rows (the routed experts', then the shared
// expert's gate), x[t] = x_hi[t] + x_lo[t] (the normed input and what its rounding to bf16 lost: about 17
// significant bits), every 8-bit weight formed exactly in f32 as scale * q + bias. A block takes a strip of
// RT_ROWS router rows and a tile of RT_TOKENS tokens over all of k, in stages of RT_KC inputs: the stage's
// weights (dequantized) and inputs are staged in shared memory while the next stage's are fetched into registers.
// Thread (part p, quad q) owns rows rq + 4i and tokens tq + 4j (rq = q / 4, tq = q % 4, i, j < 4) over the
// inputs 4 (p + 16 s) .. + 3 of each stage; the RT_PARTS parts of each output are then summed in order of p.
// Every sum runs in one fixed order, so the logits do not depend on timing. Grid (row strips, token tiles, parts
// of k): a launch of few blocks would leave most SMs idle and wait on each stage's fetch in turn, so k is cut into
// RT_K_PARTS parts of whole stages; each part's block writes its tile to `router_partials`, and the last of a
// tile's blocks to finish (a ticket) adds the parts in order of part. The parts do not depend on the number of
// tokens, so neither do a token's logits.
#define RT_THREADS ROW_THREADS
#define RT_ROWS 16
#define RT_TOKENS 16
#define RT_OUT (NUM_EXPERTS + 1)
#define RT_PARTS (RT_THREADS / ((RT_ROWS / 4) * (RT_TOKENS / 4)))
#define RT_KC (HIDDEN < 256 ? HIDDEN : 256)
// Rows of the staged tiles are padded by 8 floats: the float4s a warp reads then fall in distinct banks.
#define RT_STRIDE (RT_KC + 8)
// Float4s of each operand a thread stages per stage, and steps s of its products per stage.
#define RT_ITEMS (RT_KC / 64)

static_assert(HIDDEN % RT_KC == 0 && RT_KC % 64 == 0, "the router's stages are whole groups of 64 inputs");
static_assert(RT_PARTS == 16 && RT_ROWS * RT_TOKENS == RT_THREADS, "one summed output a thread");
static_assert(RT_ROWS == RT_TOKENS, "both tiles are staged the same way");
static_assert(RT_PARTS * RT_ROWS * (RT_TOKENS + 1) <= 2 * RT_ROWS * RT_STRIDE, "the parts fit the tiles' memory");

#ifndef RT_SPLIT
#define RT_SPLIT 4
#endif
constexpr int RT_STAGES = HIDDEN / RT_KC;
// The most parts, at most RT_SPLIT (a power of two), that cut the stages evenly.
__host__ __device__ constexpr int rt_k_parts(int split) {
    while (split > 1 && RT_STAGES % split != 0) split /= 2;
    return split;
}
constexpr int RT_K_PARTS = rt_k_parts(RT_SPLIT);
// The most tokens a launch takes (the host reads it as router_max_tokens and sends no more) and so the most tiles
// of a launch.
#define RT_MAX_TOKENS 256
constexpr int RT_MAX_TILES = ((RT_OUT + RT_ROWS - 1) / RT_ROWS) * (RT_MAX_TOKENS / RT_TOKENS);
static_assert(RT_MAX_TOKENS % RT_TOKENS == 0, "whole token tiles");
__device__ float router_partials[(size_t)RT_MAX_TILES * RT_K_PARTS * RT_ROWS * RT_TOKENS];
// A tile's count of finished parts; its last part resets it, so every launch finds it zero.
__device__ int router_tickets[RT_MAX_TILES];

// Read by the host (the constants of src/kernels/prefill.rs).
__device__ int router_strip_rows = RT_ROWS;
__device__ int router_tile_tokens = RT_TOKENS;
__device__ int router_k_parts = RT_K_PARTS;
__device__ int router_max_tokens = RT_MAX_TOKENS;

// An 8-bit code as a float: byte `e` of `word` under the exponent of 2^23, minus 2^23 (exact).
__device__ __forceinline__ float code_byte(u32 word, int e) {
    return __uint_as_float(0x4B000000u | ((word >> (8 * e)) & 0xffu)) - 8388608.f;
}

extern "C" __global__ void __launch_bounds__(RT_THREADS) router_rows(const bf16* x_hi, const bf16* x_lo, int m,
                                                                    Q4 router, float* logits) {
    wait_previous();
    if (m > RT_MAX_TOKENS || gridDim.z != RT_K_PARTS) __trap();  // the host's plan is not the kernel's
    constexpr int PER_ROW = RT_KC / 4;
    const int stage0 = blockIdx.z * (RT_STAGES / RT_K_PARTS), stage1 = stage0 + RT_STAGES / RT_K_PARTS;
    __shared__ __align__(16) float tiles[2 * RT_ROWS * RT_STRIDE];
    float* w_tile = tiles;
    float* x_tile = tiles + RT_ROWS * RT_STRIDE;
    const int tid = threadIdx.x;
    const int row0 = blockIdx.x * RT_ROWS, tok0 = blockIdx.y * RT_TOKENS;
    const int rows = min(RT_ROWS, RT_OUT - row0), tokens = min(RT_TOKENS, m - tok0);

    // Staging: item u of a thread is float4 c of tile row r (flat index tid + RT_THREADS u), so a warp fetches
    // consecutive words of one row. Rows past the strip or the tile read the last valid one (never stored).
    u32 codes[RT_ITEMS], pairs[RT_ITEMS];
    uint2 hi[RT_ITEMS], lo[RT_ITEMS];
    auto fetch = [&](int stage) {
#pragma unroll
        for (int u = 0; u < RT_ITEMS; u++) {
            const int flat = tid + RT_THREADS * u, r = flat / PER_ROW, k = stage * RT_KC + 4 * (flat % PER_ROW);
            const size_t w_row = row0 + min(r, rows - 1), x_row = tok0 + min(r, tokens - 1);
            codes[u] = router.packed[w_row * (HIDDEN / 4) + k / 4];
            pairs[u] = router.scale_bias[w_row * (HIDDEN / GROUP) + k / GROUP];
            hi[u] = *reinterpret_cast<const uint2*>(x_hi + x_row * HIDDEN + k);
            lo[u] = *reinterpret_cast<const uint2*>(x_lo + x_row * HIDDEN + k);
        }
    };
    auto store = [&]() {
#pragma unroll
        for (int u = 0; u < RT_ITEMS; u++) {
            const int flat = tid + RT_THREADS * u, at = (flat / PER_ROW) * RT_STRIDE + 4 * (flat % PER_ROW);
            const float2 f = pair_to_float2(pairs[u]);
            *reinterpret_cast<float4*>(w_tile + at) =
                make_float4(fmaf(code_byte(codes[u], 0), f.x, f.y), fmaf(code_byte(codes[u], 1), f.x, f.y),
                            fmaf(code_byte(codes[u], 2), f.x, f.y), fmaf(code_byte(codes[u], 3), f.x, f.y));
            const auto half = [](u32 v, int upper) { return __uint_as_float(upper ? v & 0xffff0000u : v << 16); };
            *reinterpret_cast<float4*>(x_tile + at) =
                make_float4(half(hi[u].x, 0) + half(lo[u].x, 0), half(hi[u].x, 1) + half(lo[u].x, 1),
                            half(hi[u].y, 0) + half(lo[u].y, 0), half(hi[u].y, 1) + half(lo[u].y, 1));
        }
    };

    const int q = tid % 16, p = tid / 16, rq = q / 4, tq = q % 4;
    // Threads whose first row or token is past the strip or the tile have nothing to compute.
    const bool active = rq < rows && tq < tokens;
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) acc[i][j] = 0.f;
    fetch(stage0);
    for (int stage = stage0; stage < stage1; stage++) {
        __syncthreads();  // the previous stage's products are done with the tiles
        store();
        __syncthreads();
        if (stage + 1 < stage1) fetch(stage + 1);
        if (!active) continue;
#pragma unroll
        for (int s = 0; s < RT_ITEMS; s++) {
            const int k = 4 * (p + 16 * s);
            float4 w[4], x[4];
#pragma unroll
            for (int i = 0; i < 4; i++) w[i] = *reinterpret_cast<const float4*>(w_tile + (rq + 4 * i) * RT_STRIDE + k);
#pragma unroll
            for (int j = 0; j < 4; j++) x[j] = *reinterpret_cast<const float4*>(x_tile + (tq + 4 * j) * RT_STRIDE + k);
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    float a = acc[i][j];
                    a = fmaf(w[i].x, x[j].x, a);
                    a = fmaf(w[i].y, x[j].y, a);
                    a = fmaf(w[i].z, x[j].z, a);
                    acc[i][j] = fmaf(w[i].w, x[j].w, a);
                }
        }
    }

    // The parts of each output, [part][row][token] (rows padded to RT_TOKENS + 1), summed in order of part.
    __syncthreads();
    float* part = tiles;
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) part[(p * RT_ROWS + rq + 4 * i) * (RT_TOKENS + 1) + tq + 4 * j] = acc[i][j];
    __syncthreads();
    const int r = tid % RT_ROWS, t = tid / RT_ROWS;
    const bool valid = r < rows && t < tokens;
    float v = 0.f;
#pragma unroll
    for (int k = 0; k < RT_PARTS; k++) v += part[(k * RT_ROWS + r) * (RT_TOKENS + 1) + t];
    float* out = logits + (size_t)(tok0 + t) * RT_OUT + row0 + r;
    if constexpr (RT_K_PARTS == 1) {
        if (valid) *out = v;
    } else {
        // This part's tile, then a ticket: every thread's store is visible on the GPU before the count says so.
        const int tile = blockIdx.y * gridDim.x + blockIdx.x;
        float* parts = router_partials + (size_t)tile * RT_K_PARTS * RT_THREADS;
        parts[blockIdx.z * RT_THREADS + tid] = v;
        __threadfence();
        __syncthreads();
        __shared__ bool last;
        if (tid == 0) last = atomicAdd(&router_tickets[tile], 1) == RT_K_PARTS - 1;
        __syncthreads();
        if (!last) return;
        __threadfence();
        float sum = 0.f;
#pragma unroll
        for (int z = 0; z < RT_K_PARTS; z++) sum += __ldcg(parts + z * RT_THREADS + tid);
        if (valid) *out = sum;
        if (tid == 0) router_tickets[tile] = 0;
    }
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
            if (e < NUM_EXPERTS && RANKS_BEFORE(v[i], e, best, best_e)) best = v[i], best_e = e;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ob = __shfl_xor_sync(0xffffffffu, best, o);
            const int oe = __shfl_xor_sync(0xffffffffu, best_e, o);
            if (RANKS_BEFORE(ob, oe, best, best_e)) best = ob, best_e = oe;
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

// The grouped expert products take the shared expert as expert NUM_EXPERTS: a token has MOE_SLOTS entries,
// token * MOE_SLOTS + slot.
// One warp per token: route_ids/route_w [t][MOE_SLOTS] (the shared expert and its sigmoid gate in the last slot),
// counts[e] += entries of expert e (zeroed before; e = NUM_EXPERTS the shared one). logits: [t][NUM_EXPERTS + 1].
extern "C" __global__ void __launch_bounds__(ROW_THREADS) route_rows(const float* logits, int t, int* route_ids,
                                                                    float* route_w, int* counts) {
    wait_previous();
    __shared__ int ids[ROW_THREADS / WARP][TOP_K];
    __shared__ float weights[ROW_THREADS / WARP][TOP_K];
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int token = blockIdx.x * (ROW_THREADS / WARP) + warp;
    if (token >= t) return;
    const float* l = logits + (size_t)token * (NUM_EXPERTS + 1);
    route(l, ids[warp], weights[warp]);
    if (lane < TOP_K) {
        route_ids[token * MOE_SLOTS + lane] = ids[warp][lane];
        route_w[token * MOE_SLOTS + lane] = weights[warp][lane];
        atomicAdd(&counts[ids[warp][lane]], 1);
    }
    if (lane == TOP_K) {
        route_ids[token * MOE_SLOTS + TOP_K] = NUM_EXPERTS;
        route_w[token * MOE_SLOTS + TOP_K] = sigmoidf_(l[NUM_EXPERTS]);
        atomicAdd(&counts[NUM_EXPERTS], 1);
    }
}

__device__ __forceinline__ int block_sum_int(int v, int* scratch) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    int total = 0;
#pragma unroll
    for (int w = 0; w < SORT_THREADS / WARP; w++) total += scratch[w];
    return total;
}

// Block e: expert e's place in the sorted order (offsets[e], and offsets[GROUPS] = t * MOE_SLOTS), its tiles of
// `tile_rows` entries (tiles[i] = (expert, first sorted index); *tile_count = all tiles), and its entries in
// ascending order (a stable sort, so the grouped products and their sums are deterministic). Grid (GROUPS): the
// routed experts and the shared one.
extern "C" __global__ void __launch_bounds__(SORT_THREADS) moe_sort(const int* route_ids, int t, const int* counts,
                                                                   int tile_rows, int* offsets, int* entries,
                                                                   int* tiles, int* tile_count) {
    wait_previous();
    __shared__ int scratch[SORT_THREADS / WARP];
    __shared__ int warp_totals[SORT_THREADS / WARP];
    const int e = blockIdx.x, lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    constexpr int GROUPS = NUM_EXPERTS + 1;
    int before = 0, tiles_before = 0, tiles_all = 0;
    for (int i = threadIdx.x; i < GROUPS; i += SORT_THREADS) {
        const int n = counts[i], n_tiles = (n + tile_rows - 1) / tile_rows;
        if (i < e) before += n, tiles_before += n_tiles;
        tiles_all += n_tiles;
    }
    const int offset = block_sum_int(before, scratch);
    const int first_tile = block_sum_int(tiles_before, scratch);
    const int total_tiles = block_sum_int(tiles_all, scratch);
    const int count = counts[e];
    if (threadIdx.x == 0) {
        offsets[e] = offset;
        if (e == GROUPS - 1) offsets[GROUPS] = offset + count, *tile_count = total_tiles;
    }
    for (int j = threadIdx.x; j * tile_rows < count; j += SORT_THREADS) {
        tiles[2 * (first_tile + j)] = e;
        tiles[2 * (first_tile + j) + 1] = offset + j * tile_rows;
    }
    // Four consecutive entries a thread per pass; ranks from a warp scan of the match counts, then the warps'.
    const int n_entries = t * MOE_SLOTS;
    int rank = offset;
    for (int base = 0; base < n_entries; base += 4 * SORT_THREADS) {
        const int i0 = base + 4 * threadIdx.x;
        int match[4], mine = 0;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            match[j] = i0 + j < n_entries && route_ids[i0 + j] == e;
            mine += match[j];
        }
        int inclusive = mine;
#pragma unroll
        for (int o = 1; o < WARP; o <<= 1) {
            const int v = __shfl_up_sync(0xffffffffu, inclusive, o);
            if (lane >= o) inclusive += v;
        }
        if (lane == WARP - 1) warp_totals[warp] = inclusive;
        __syncthreads();
        int at = rank + inclusive - mine, pass_total = 0;
#pragma unroll
        for (int w = 0; w < SORT_THREADS / WARP; w++) {
            if (w < warp) at += warp_totals[w];
            pass_total += warp_totals[w];
        }
#pragma unroll
        for (int j = 0; j < 4; j++)
            if (match[j]) entries[at++] = i0 + j;
        rank += pass_total;
        __syncthreads();
    }
}

// hidden[r] += the sum over slots of expert_out[r * MOE_SLOTS + slot] (each already weighted; the shared expert's
// last), for the rows whose next kernel is not an rmsnorm_rows that adds them itself. Grid (t).
extern "C" __global__ void __launch_bounds__(ROW_THREADS) moe_combine(float* hidden, const float* expert_out) {
    wait_previous();
    const size_t r = blockIdx.x;
    for (int c = threadIdx.x; c < HIDDEN; c += ROW_THREADS) hidden[r * HIDDEN + c] += combined_experts(expert_out, r, c);
}
