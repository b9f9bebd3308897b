// Prefill glue around the matrix products (gemm.cu): the chunk's embedding rows, RMSNorm rows into the bf16 input
// of the next product, every token's routing, a stable counting sort of the (token, slot) entries by expert with
// the tile list of the grouped expert products, and the MoE's combine into the residual stream.

#define ROW_THREADS 256
#define SORT_THREADS 256

// hidden[r] = the dequantized embedding row of tokens[start + r]. Grid (t).
extern "C" __global__ void __launch_bounds__(ROW_THREADS) embed_rows(const int* tokens, int start, Q4 table,
                                                                    float* hidden) {
    const int token = tokens[start + blockIdx.x];
    float* out = hidden + (size_t)blockIdx.x * HIDDEN;
    for (int c = threadIdx.x; c < HIDDEN; c += ROW_THREADS) {
        const u32 word = table.packed[(size_t)token * (HIDDEN / 8) + c / 8];
        const float2 f = pair_to_float2(table.scale_bias[(size_t)token * (HIDDEN / GROUP) + c / GROUP]);
        out[c] = f.x * nibble_to_float(word, 4 * (c % 8)) + f.y;
    }
}

// out[r] = bf16(rmsnorm(hidden[r]) * norm), and where `out_lo` is not null what that rounding lost, also in bf16
// (the router's products take both: routing is decided by small differences between logits). Grid (t).
extern "C" __global__ void __launch_bounds__(ROW_THREADS) rmsnorm_rows(const float* hidden, const float* norm,
                                                                      bf16* out, bf16* out_lo) {
    constexpr int PER = (HIDDEN + ROW_THREADS - 1) / ROW_THREADS;
    __shared__ float scratch[32];
    const float* h = hidden + (size_t)blockIdx.x * HIDDEN;
    float v[PER];
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < PER; i++) {
        const int c = threadIdx.x + i * ROW_THREADS;
        v[i] = c < HIDDEN ? h[c] : 0.f;
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
        if (out_lo) out_lo[(size_t)blockIdx.x * HIDDEN + c] = float_to_bf16(x - bf16_to_float(hi));
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

// One warp per token: route_ids/route_w [t][TOP_K] (entry token*TOP_K + slot), shared_w[token] = the shared
// expert's sigmoid gate, counts[e] += tokens routed to e (zeroed before). logits: [t][NUM_EXPERTS + 1].
extern "C" __global__ void __launch_bounds__(ROW_THREADS) route_rows(const float* logits, int t, int* route_ids,
                                                                    float* route_w, float* shared_w, int* counts) {
    __shared__ int ids[ROW_THREADS / WARP][TOP_K];
    __shared__ float weights[ROW_THREADS / WARP][TOP_K];
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int token = blockIdx.x * (ROW_THREADS / WARP) + warp;
    if (token >= t) return;
    const float* l = logits + (size_t)token * (NUM_EXPERTS + 1);
    route(l, ids[warp], weights[warp]);
    if (lane < TOP_K) {
        route_ids[token * TOP_K + lane] = ids[warp][lane];
        route_w[token * TOP_K + lane] = weights[warp][lane];
        atomicAdd(&counts[ids[warp][lane]], 1);
    }
    if (lane == 0) shared_w[token] = sigmoidf_(l[NUM_EXPERTS]);
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

// Block e: expert e's place in the sorted order (offsets[e], and offsets[NUM_EXPERTS] = t * TOP_K), its tiles of
// `tile_rows` entries (tiles[i] = (expert, first sorted index); *tile_count = all tiles), and its entries in
// ascending order (a stable sort, so the grouped products and their sums are deterministic). Grid (NUM_EXPERTS).
extern "C" __global__ void __launch_bounds__(SORT_THREADS) moe_sort(const int* route_ids, int t, const int* counts,
                                                                   int tile_rows, int* offsets, int* entries,
                                                                   int* tiles, int* tile_count) {
    __shared__ int scratch[SORT_THREADS / WARP];
    __shared__ int warp_totals[SORT_THREADS / WARP];
    const int e = blockIdx.x, lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    int before = 0, tiles_before = 0, tiles_all = 0;
    for (int i = threadIdx.x; i < NUM_EXPERTS; i += SORT_THREADS) {
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
        if (e == NUM_EXPERTS - 1) offsets[NUM_EXPERTS] = offset + count, *tile_count = total_tiles;
    }
    for (int j = threadIdx.x; j * tile_rows < count; j += SORT_THREADS) {
        tiles[2 * (first_tile + j)] = e;
        tiles[2 * (first_tile + j) + 1] = offset + j * tile_rows;
    }
    // Four consecutive entries a thread per pass; ranks from a warp scan of the match counts, then the warps'.
    const int n_entries = t * TOP_K;
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

// hidden[r] += sum_slot expert_out[r * TOP_K + slot] + shared_w[r] * shared_out[r]. Grid (t).
extern "C" __global__ void __launch_bounds__(ROW_THREADS) moe_combine(float* hidden, const float* expert_out,
                                                                     const float* shared_out,
                                                                     const float* shared_w) {
    const size_t r = blockIdx.x;
    const float gate = shared_w[r];
    for (int c = threadIdx.x; c < HIDDEN; c += ROW_THREADS) {
        float s = 0.f;
#pragma unroll
        for (int k = 0; k < TOP_K; k++) s += expert_out[(r * TOP_K + k) * HIDDEN + c];
        hidden[r * HIDDEN + c] += s + gate * shared_out[r * HIDDEN + c];
    }
}
