// The sparse MoE block: router (8-bit) and shared-expert gate in one launch; routing (softmax, top-k,
// renormalise) recomputed by every block of the gate/up launch, which runs the gate and up projections of the
// routed and the shared experts together; the down projections with the routing weights applied and the
// residual add in a third launch. Chosen experts' weights are read in place from the stacked tensors.

static_assert(SHARED_INTER == MOE_INTER, "the shared expert runs beside the routed ones");
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
    allow_next();
    uint4 qs[PER_LANE];
    u32 sbs[PER_LANE];
#pragma unroll
    for (int k = 0; k < PER_LANE; k++) {
        const int u = min(lane + WARP * k, CHUNKS - 1);
        qs[k] = load_stream(w.packed + (size_t)row * (HIDDEN / 4) + 4 * u);
        sbs[k] = w.scale_bias[(size_t)row * (HIDDEN / GROUP) + u / 4];
    }
    wait_previous();
    rmsnorm_to_shared<HIDDEN, MV_THREADS>(hidden, norm, xs, scratch);
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

// The gate/up launch: a block takes one strip of 16 (gate, up) row pairs of one slot, its 8 warps splitting the
// inputs (two tiles of 128 each at the full shape): 288 blocks.
#define GATE_UP_KSPLIT 8
typedef Matvec<HIDDEN, GATE_UP_KSPLIT> GateUpShape;
#define GATE_UP_PAIRS GateUpShape::ROWS_PER_BLOCK
static_assert(MOE_INTER % GATE_UP_PAIRS == 0, "a block's pairs lie in one slot");

// act[slot][i] = silu(gate_e[i] . x) * (up_e[i] . x), x = rmsnorm(hidden), for the routed experts e and the shared
// expert (slot TOP_K). Block 0 also publishes the routing: ids, weights and the shared expert's sigmoid gate.
extern "C" __global__ void __launch_bounds__(MV_THREADS) experts_gate_up(
    const float* hidden, const float* norm, const float* logits, Q4 gate, Q4 up, Q4 shared_gate, Q4 shared_up,
    float* act, int* route_ids, float* route_w) {
    begin_dependent();
    typedef StripLane<HIDDEN> Lane;
    constexpr int KSPLIT = GateUpShape::KSPLIT, TPW = GateUpShape::TPW;
    __shared__ StagedX<HIDDEN> st;
    __shared__ float part_gate[KSPLIT][GATE_UP_PAIRS], part_up[KSPLIT][GATE_UP_PAIRS];
    __shared__ float sum_sq[MV_THREADS / WARP];
    __shared__ int ids[TOP_K];
    __shared__ float weights[TOP_K];
    const int warp = threadIdx.x / WARP, strip = warp / KSPLIT, kpart = warp % KSPLIT;
    // Warp 0 routes while the others stage the normed input (its 1 / rms applied after the products).
    if (warp == 0) {
        route(logits, ids, weights);
        if (threadIdx.x == 0) sum_sq[0] = 0.f;
    } else {
        const float sq = stage_x<HIDDEN, MV_THREADS / WARP - 1>(NormedInput{hidden, norm}, st, warp - 1);
        if (threadIdx.x % WARP == 0) sum_sq[warp] = sq;
    }
    __syncthreads();
    if (blockIdx.x == 0 && threadIdx.x < SLOTS) {
        if (threadIdx.x < TOP_K) route_ids[threadIdx.x] = ids[threadIdx.x], route_w[threadIdx.x] = weights[threadIdx.x];
        else route_w[TOP_K] = sigmoidf_(logits[NUM_EXPERTS]);
    }
    const int pair0 = blockIdx.x * GATE_UP_PAIRS, slot = pair0 / MOE_INTER;
    const int i0 = pair0 % MOE_INTER + 16 * strip;
    const bool routed = slot < TOP_K;
    const Q4 mg = routed ? gate : shared_gate, mu = routed ? up : shared_up;
    const int row0 = routed ? ids[slot] * MOE_INTER + i0 : i0;
    Lane lane;
    lane.init(st);
    typename Lane::Tile tg[TPW], tu[TPW];
#pragma unroll
    for (int i = 0; i < TPW; i++) {
        tg[i] = lane.load(mg, row0, 1 << 30, kpart * TPW + i);
        tu[i] = lane.load(mu, row0, 1 << 30, kpart * TPW + i);
    }
    float ss = 0.f;
#pragma unroll
    for (int w = 0; w < MV_THREADS / WARP; w++) ss += sum_sq[w];
    const float inv = rms_inv(ss, HIDDEN);
    float2 ag = make_float2(0.f, 0.f), au = make_float2(0.f, 0.f);
#pragma unroll
    for (int i = 0; i < TPW; i++) {
        lane.dot(tg[i], kpart * TPW + i, ag);
        lane.dot(tu[i], kpart * TPW + i, au);
    }
    const float vg = lane.row_total(ag) * inv, vu = lane.row_total(au) * inv;
    if (lane.holds_row()) {
        part_gate[kpart][16 * strip + lane.row()] = vg;
        part_up[kpart][16 * strip + lane.row()] = vu;
    }
    __syncthreads();
    for (int r = threadIdx.x; r < GATE_UP_PAIRS; r += MV_THREADS) {
        float g = 0.f, u = 0.f;
#pragma unroll
        for (int k = 0; k < KSPLIT; k++) g += part_gate[k][r], u += part_up[k][r];
        act[pair0 + r] = siluf_(g) * u;
    }
}

// hidden[r] += sum_slot weight_slot * (down_e[r] . act[slot]): a block takes 16 rows, one warp a slot; each warp
// stages its own slot's input.
extern "C" __global__ void __launch_bounds__(SLOTS * WARP) experts_down(const float* act, const int* route_ids,
                                                                       const float* route_w, Q4 down,
                                                                       Q4 shared_down, float* hidden) {
    begin_dependent();
    typedef StripLane<MOE_INTER> Lane;
    constexpr int TILES = MOE_INTER / MV_TILE;
    __shared__ StagedX<MOE_INTER> st[SLOTS];
    __shared__ float part[SLOTS][16];
    const int slot = threadIdx.x / WARP;
    const Q4 m = slot < TOP_K ? down : shared_down;
    const int row0 = (slot < TOP_K ? route_ids[slot] * HIDDEN : 0) + blockIdx.x * 16;
    const float weight = route_w[slot];
    Lane lane;
    lane.init(st[slot]);
    typename Lane::Tile tiles[TILES];
#pragma unroll
    for (int j = 0; j < TILES; j++) tiles[j] = lane.load(m, row0, 1 << 30, j);
    stage_x<MOE_INTER, 1>(PlainInput{act + slot * MOE_INTER}, st[slot], 0);
    __syncwarp();
    float2 acc = make_float2(0.f, 0.f);
#pragma unroll
    for (int j = 0; j < TILES; j++) lane.dot(tiles[j], j, acc);
    const float v = lane.row_total(acc);
    if (lane.holds_row()) part[slot][lane.row()] = weight * v;
    __syncthreads();
    if (threadIdx.x < 16) {
        float s = 0.f;
#pragma unroll
        for (int k = 0; k < SLOTS; k++) s += part[k][threadIdx.x];
        hidden[blockIdx.x * 16 + threadIdx.x] += s;
    }
}

// Block sizes of the gate/up and down launches; the host sizes grids with them.
extern "C" __device__ const int pairs_per_block = GATE_UP_PAIRS;
extern "C" __device__ const int gate_up_threads = MV_THREADS;
extern "C" __device__ const int down_rows_per_block = 16;
