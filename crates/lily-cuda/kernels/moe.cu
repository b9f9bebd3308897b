// The sparse MoE block: router (8-bit) and shared-expert gate in one launch; routing (softmax, top-k,
// renormalise) recomputed by every block of the gate/up launch, which runs the gate and up projections of the
// routed and the shared experts together; the down projections with the routing weights applied and the
// residual add in a third launch. Chosen experts' weights are read in place from the stacked tensors.

static_assert(SHARED_INTER == MOE_INTER, "the shared expert runs beside the routed ones");
static_assert(HIDDEN <= 2048, "gate/up keep the whole input (64 floats a lane) in registers");
#define SLOTS (TOP_K + 1)  // routed experts, then the shared expert

// logits[e] = router[e] . rmsnorm(hidden) for e < NUM_EXPERTS, and logits[NUM_EXPERTS] = the shared expert's
// gate; both 8-bit matrices, stacked.
extern "C" __global__ void __launch_bounds__(MV_THREADS) router(const float* hidden, const float* norm, Q4 w,
                                                                float* logits) {
    constexpr int CHUNKS = HIDDEN / 16;  // 16 bytes of 8-bit values each
    constexpr int PER_LANE = (CHUNKS + WARP - 1) / WARP;
    __shared__ float xs[HIDDEN];
    __shared__ float scratch[32];
    const int lane = threadIdx.x % WARP;
    const int row = min(blockIdx.x * (MV_THREADS / WARP) + threadIdx.x / WARP, NUM_EXPERTS);
    uint4 qs[PER_LANE];
    u32 sbs[PER_LANE];
#pragma unroll
    for (int k = 0; k < PER_LANE; k++) {
        const int u = min(lane + WARP * k, CHUNKS - 1);
        qs[k] = load_stream(w.packed + (size_t)row * (HIDDEN / 4) + 4 * u);
        sbs[k] = w.scale_bias[(size_t)row * (HIDDEN / GROUP) + u / 4];
    }
    rmsnorm_to_shared<HIDDEN, MV_THREADS, false>(hidden, norm, xs, scratch);
    if (blockIdx.x * (MV_THREADS / WARP) + threadIdx.x / WARP > NUM_EXPERTS) return;
    float acc = 0.f;
#pragma unroll
    for (int k = 0; k < PER_LANE; k++) {
        const int u = lane + WARP * k;
        if (u >= CHUNKS) break;
        const uint4 q = qs[k];
        const float2 f = pair_to_float2(sbs[k]);
        const float* x = xs + 16 * u;
        const u32 words[4] = {q.x, q.y, q.z, q.w};
        float qx = 0.f, sx = 0.f;
#pragma unroll
        for (int m = 0; m < 4; m++)
#pragma unroll
            for (int j = 0; j < 4; j++) {
                qx = fmaf(byte_to_float(words[m], 8 * j), x[4 * m + j], qx);
                sx += x[4 * m + j];
            }
        acc += f.x * qx + f.y * sx;
    }
    acc = warp_sum(acc);
    if (lane == 0) logits[row] = acc;
}

// The gate/up launch: 6 warps of 3 row passes (each pass loads a gate and an up row) make 256 blocks at the full
// shape, one wave at 2 blocks an SM (8 warps of 2 passes made 288 blocks: two waves on 132 SMs). One pass at the
// full width (more, smaller blocks) measured slower.
#define GATE_UP_THREADS 192
#define GATE_UP_PASSES (RowDot4<HIDDEN, HIDDEN>::UPL >= 2 ? 3 : 4)

// act[slot][i] = silu(gate_e[i] . x) * (up_e[i] . x), x = rmsnorm(hidden), for the routed experts e and the shared
// expert (slot TOP_K). Block 0 also publishes the routing: ids, weights and the shared expert's sigmoid gate.
extern "C" __global__ void __launch_bounds__(GATE_UP_THREADS) experts_gate_up(
    const float* hidden, const float* norm, const float* logits, Q4 gate, Q4 up, Q4 shared_gate, Q4 shared_up,
    float* act, int* route_ids, float* route_w) {
    typedef RowDot4<HIDDEN, HIDDEN> Dot;
    constexpr int PASSES = GATE_UP_PASSES;
    constexpr int PAIRS_PER_BLOCK = (GATE_UP_THREADS / WARP) * PASSES * Dot::RPP;
    __shared__ float xs[HIDDEN];
    __shared__ float scratch[32];
    __shared__ int ids[TOP_K];
    __shared__ float weights[TOP_K];
    if (threadIdx.x < WARP) route(logits, ids, weights);
    rmsnorm_to_shared<HIDDEN, GATE_UP_THREADS, true>(hidden, norm, xs, scratch);
    if (blockIdx.x == 0 && threadIdx.x < SLOTS) {
        if (threadIdx.x < TOP_K) route_ids[threadIdx.x] = ids[threadIdx.x], route_w[threadIdx.x] = weights[threadIdx.x];
        else route_w[TOP_K] = sigmoidf_(logits[NUM_EXPERTS]);
    }
    Dot d;
    d.init(0);
    d.load_x(xs);
    uint4 wg[PASSES][Dot::UPL], wu[PASSES][Dot::UPL];
    u32 sg[PASSES][Dot::UPL], su[PASSES][Dot::UPL];
    const int base = blockIdx.x * PAIRS_PER_BLOCK + (threadIdx.x / WARP) * PASSES * Dot::RPP;
#pragma unroll
    for (int p = 0; p < PASSES; p++) {
        const int pair = min(base + p * Dot::RPP + d.row_in_pass(), SLOTS * MOE_INTER - 1);
        const int slot = pair / MOE_INTER, i = pair % MOE_INTER;
        if (slot < TOP_K) {
            const int row = ids[slot] * MOE_INTER + i;
            d.load_row(gate, row, wg[p], sg[p]);
            d.load_row(up, row, wu[p], su[p]);
        } else {
            d.load_row(shared_gate, i, wg[p], sg[p]);
            d.load_row(shared_up, i, wu[p], su[p]);
        }
    }
#pragma unroll
    for (int p = 0; p < PASSES; p++) {
        const int pair = base + p * Dot::RPP + d.row_in_pass();
        const float g = Dot::reduce(d.partial(wg[p], sg[p]));
        const float u = Dot::reduce(d.partial(wu[p], su[p]));
        if (d.sub == 0 && pair < SLOTS * MOE_INTER) act[pair] = siluf_(g) * u;
    }
}

// hidden[r] += sum_slot weight_slot * (down_e[r] . act[slot]): one warp per slot, DOWN_ROWS rows per block.
#define DOWN_PASSES 8
extern "C" __global__ void __launch_bounds__(SLOTS * WARP) experts_down(const float* act, const int* route_ids,
                                                                       const float* route_w, Q4 down,
                                                                       Q4 shared_down, float* hidden) {
    typedef RowDot4<MOE_INTER, MOE_INTER> Dot;
    constexpr int ROWS = DOWN_PASSES * Dot::RPP;
    __shared__ float xs[SLOTS][MOE_INTER];
    __shared__ float part[SLOTS][ROWS];
    const int slot = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    copy_to_shared_swizzled<MOE_INTER, WARP>(act + slot * MOE_INTER, xs[slot], lane);
    __syncwarp();
    Dot d;
    d.init(0);
    d.load_x(xs[slot]);
    const Q4 m = slot < TOP_K ? down : shared_down;
    const int row0 = slot < TOP_K ? route_ids[slot] * HIDDEN : 0;
    const float weight = route_w[slot];
    uint4 w[DOWN_PASSES][Dot::UPL];
    u32 sb[DOWN_PASSES][Dot::UPL];
    const int first = blockIdx.x * ROWS;
#pragma unroll
    for (int p = 0; p < DOWN_PASSES; p++)
        d.load_row(m, row0 + min(first + p * Dot::RPP + d.row_in_pass(), HIDDEN - 1), w[p], sb[p]);
#pragma unroll
    for (int p = 0; p < DOWN_PASSES; p++) {
        const float v = Dot::reduce(d.partial(w[p], sb[p]));
        if (d.sub == 0) part[slot][p * Dot::RPP + d.row_in_pass()] = weight * v;
    }
    __syncthreads();
    for (int r = threadIdx.x; r < ROWS; r += blockDim.x) {
        if (first + r >= HIDDEN) continue;
        float s = 0.f;
#pragma unroll
        for (int k = 0; k < SLOTS; k++) s += part[k][r];
        hidden[first + r] += s;
    }
}

// Block sizes of the gate/up and down launches; the host sizes grids with them.
extern "C" __device__ const int pairs_per_block = (GATE_UP_THREADS / WARP) * GATE_UP_PASSES * RowDot4<HIDDEN, HIDDEN>::RPP;
extern "C" __device__ const int gate_up_threads = GATE_UP_THREADS;
extern "C" __device__ const int down_rows_per_block = DOWN_PASSES * RowDot4<MOE_INTER, MOE_INTER>::RPP;
