// The sparse MoE block in two launches. The first computes the router (8-bit), routes (the top-k logits, then
// their softmax: the renormalised top-k of the full softmax) and runs the gate and up projections of the routed
// and the shared experts; the second the down projections with the routing weights applied and the residual add.
// Chosen experts' weights are read in place from the stacked tensors (tiled: see common.cuh).
//
// The second launch's weights depend only on the routing, published before the first launch ends: block 0 of
// the first sets a flag once the routing is written, and the second requests its chosen experts' rows as soon as
// it sees the flag (its blocks start while the first launch is still running), so those rows come from DRAM while
// the first launch computes. The flag is cleared by the first launch before its wait: the second of the previous
// layer, its only reader, has ended by then, and the second of this layer starts only after that.
//
// Every block of the first launch needs the routing, so every block needs all the router's logits. On Hopper a
// cluster of blocks shares them: each block computes one strip of 16 router rows (its weights requested before the
// wait) and reads the others' from its neighbours' shared memory. Elsewhere each block computes them all.


// The gate/up launch: a block takes one strip of 16 (gate, up) row pairs of one slot, its 8 warps splitting the
// inputs (two tiles of 128 each at the full shape): 288 blocks.
#define GATE_UP_KSPLIT 8
typedef Matvec<HIDDEN, GATE_UP_KSPLIT> GateUpShape;
#define GATE_UP_PAIRS GateUpShape::ROWS_PER_BLOCK
#define GATE_UP_BLOCKS_PER_SLOT (MOE_INTER / GATE_UP_PAIRS)
static_assert(MOE_INTER % GATE_UP_PAIRS == 0, "a block's pairs lie in one slot");

#define ROUTER_STRIPS (NUM_EXPERTS / 16)
// Up to 16 blocks a cluster (Hopper's largest), one router strip each.
#if __CUDA_ARCH__ >= 900 && ROUTER_STRIPS > 1
#define GATE_UP_CLUSTER (ROUTER_STRIPS < 16 ? ROUTER_STRIPS : 16)
#define GATE_UP_CLUSTER_DIMS __cluster_dims__(GATE_UP_CLUSTER, 1, 1)
#else
#define GATE_UP_CLUSTER 1
#define GATE_UP_CLUSTER_DIMS
#endif
static_assert(NUM_EXPERTS % 16 == 0 && ROUTER_STRIPS % GATE_UP_CLUSTER == 0, "router strips split evenly");
static_assert(GATE_UP_BLOCKS_PER_SLOT % GATE_UP_CLUSTER == 0, "a cluster's blocks serve one slot");
static_assert(NUM_EXPERTS <= MV_THREADS && (NUM_EXPERTS % WARP == 0 || NUM_EXPERTS < WARP) &&
                  TOP_K <= (NUM_EXPERTS < WARP ? NUM_EXPERTS : WARP),
              "top-k: a thread an expert, at least TOP_K experts a warp");

#if GATE_UP_CLUSTER > 1
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }
__device__ __forceinline__ u32 cluster_rank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
// `*local` in the shared memory of the cluster's block `rank`.
__device__ __forceinline__ float load_from_block(const float* local, u32 rank) {
    u32 addr, remote;
    float v;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(addr) : "l"(local));
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
    return v;
}
#endif

__device__ __forceinline__ u32 load_acquire(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void store_release(u32* p, u32 v) {
    asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ int load_relaxed(const int* p) {
    int v;
    asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// The TOP_K largest of `logits` in order into ids / chosen, by rank counting in two rounds: each warp's 32 experts
// against each other (a warp's TOP_K best are the candidates), then the candidates against each other (every
// expert that ranks before one of the TOP_K best is a candidate). One thread an expert; the block calls it.
#define TOP_K_GROUP (NUM_EXPERTS < WARP ? NUM_EXPERTS : WARP)
#define TOP_K_CANDIDATES (NUM_EXPERTS / TOP_K_GROUP * TOP_K)
__device__ __forceinline__ void top_k(const float* logits, float* cand_v, int* cand_e, int* ids, float* chosen) {
    constexpr int GROUP_SIZE = TOP_K_GROUP, CANDIDATES = TOP_K_CANDIDATES;
    const int e = threadIdx.x, group = e / GROUP_SIZE;
    if (e < NUM_EXPERTS) {
        const float v = rank_value(logits[e]);
        const float* peers = logits + group * GROUP_SIZE;
        int rank = 0;
#pragma unroll 8
        for (int i = 0; i < GROUP_SIZE; i++)
            rank += ranks_before(rank_value(peers[i]), group * GROUP_SIZE + i, v, e);
        if (rank < TOP_K) cand_v[group * TOP_K + rank] = v, cand_e[group * TOP_K + rank] = e;
    }
    __syncthreads();
    if (e < CANDIDATES) {
        const float v = cand_v[e];
        const int id = cand_e[e];
        int rank = 0;
#pragma unroll 8
        for (int i = 0; i < CANDIDATES; i++) rank += ranks_before(cand_v[i], cand_e[i], v, id);
        if (rank < TOP_K) ids[rank] = id, chosen[rank] = v;
    }
    __syncthreads();
}

// logits[e] = router[e] . x for e < NUM_EXPERTS and logits[NUM_EXPERTS] = the shared expert's gate (both 8-bit,
// stacked in `router`), x = rmsnorm(hidden); the routing; then act[slot][i] = silu(gate_e[i] . x) * (up_e[i] . x)
// for the routed experts e and the shared expert (slot TOP_K). Block 0 publishes the routing (ids, weights, then
// `route_ready` = 1), the shared expert's first block its sigmoid gate; the logits are written for the self-test.
extern "C" __global__ void __launch_bounds__(MV_THREADS, 3) GATE_UP_CLUSTER_DIMS experts_gate_up(
    const float* hidden, const float* norm, Q4 router, Q4 gate, Q4 up, Q4 shared_gate, Q4 shared_up,
    float* logits, float* act, int* route_ids, float* route_w, u32* route_ready) {
    typedef StripLane<HIDDEN> Lane;
    constexpr int KSPLIT = GateUpShape::KSPLIT, TPW = GateUpShape::TPW, WARPS = MV_THREADS / WARP;
    constexpr int R_TILES = HIDDEN / MV_TILE, R_TPW = (R_TILES + WARPS - 1) / WARPS;
    constexpr int SPB = ROUTER_STRIPS / GATE_UP_CLUSTER;  // router strips a routed block computes
    __shared__ StagedX<HIDDEN> st;
    __shared__ float part_gate[KSPLIT][GATE_UP_PAIRS], part_up[KSPLIT][GATE_UP_PAIRS];
    __shared__ float part_router[SPB][WARPS][16];
    __shared__ float sum_sq[WARPS];
    __shared__ __align__(16) float own_logits[SPB * 16];
    __shared__ float cand_v[TOP_K_CANDIDATES], chosen[TOP_K];
    __shared__ int cand_e[TOP_K_CANDIDATES], ids[TOP_K];
#if GATE_UP_CLUSTER > 1
    __shared__ __align__(16) float gathered[NUM_EXPERTS];
    const int rank = (int)cluster_rank();
#else
    const int rank = 0;
#endif
    const int warp = threadIdx.x / WARP, strip = warp / KSPLIT, kpart = warp % KSPLIT;
    const int pair0 = blockIdx.x * GATE_UP_PAIRS, slot = pair0 / MOE_INTER;
    const int i0 = pair0 % MOE_INTER + 16 * strip;
    const bool routed = slot < TOP_K;
    // Router strip i of this block: rows 16 (rank + i * cluster) of the routed experts' router, or (shared expert's
    // blocks, one strip) the shared expert's gate row repeated.
    const int strips = routed ? SPB : 1;
    auto router_row = [&](int i) { return routed ? 16 * (rank + i * GATE_UP_CLUSTER) : NUM_EXPERTS; };
    Lane lane;
    lane.init(st);
    // With a cluster a block's strips are requested before the wait; without one (all strips) as they are used.
    constexpr bool EARLY = SPB <= 2;
    typename Lane::Tile8 rt[EARLY ? SPB : 1][R_TPW];
    auto load_strip = [&](int i, typename Lane::Tile8 (&tiles)[R_TPW]) {
#pragma unroll
        for (int p = 0; p < R_TPW; p++)
            if (warp + p * WARPS < R_TILES) tiles[p] = lane.load8(router, router_row(i), NUM_EXPERTS + 1, warp + p * WARPS);
    };
    if (EARLY)
#pragma unroll
        for (int i = 0; i < SPB; i++)
            if (i < strips) load_strip(i, rt[EARLY ? i : 0]);
    Stager<HIDDEN, WARPS, NormedInput> stager{NormedInput{hidden, norm}};
    stager.prefetch(warp);
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        *route_ready = 0;
        __threadfence();
    }
    wait_previous();

    {
        const float sq = stager.stage(st, warp);
        if (threadIdx.x % WARP == 0) sum_sq[warp] = sq;
    }
    __syncthreads();
    float ss = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; w++) ss += sum_sq[w];
    const float inv = rms_inv(ss, HIDDEN);
#pragma unroll
    for (int i = 0; i < SPB; i++) {
        if (i >= strips) break;
        if (!EARLY) load_strip(i, rt[0]);
        float2 acc = make_float2(0.f, 0.f);
#pragma unroll
        for (int p = 0; p < R_TPW; p++)
            if (warp + p * WARPS < R_TILES) lane.dot8(rt[EARLY ? i : 0][p], warp + p * WARPS, acc);
        const float v = lane.row_total(acc);
        if (lane.holds_row()) part_router[i][warp][lane.row()] = v;
    }
    __syncthreads();
    if (threadIdx.x < strips * 16) {
        const int i = threadIdx.x / 16, r = threadIdx.x % 16;
        float v = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; w++) v += part_router[i][w][r];
        v *= inv;
        own_logits[threadIdx.x] = v;
        if (routed && blockIdx.x < GATE_UP_CLUSTER) logits[router_row(i) + r] = v;
        if (!routed && blockIdx.x == TOP_K * GATE_UP_BLOCKS_PER_SLOT && threadIdx.x == 0)
            logits[NUM_EXPERTS] = v, route_w[TOP_K] = sigmoidf_(v);
    }

    if (routed) {
#if GATE_UP_CLUSTER > 1
        cluster_arrive();
        cluster_wait();
        for (int e = threadIdx.x; e < NUM_EXPERTS; e += MV_THREADS) {
            const int s = e / 16;
            gathered[e] = load_from_block(&own_logits[(s / GATE_UP_CLUSTER) * 16 + e % 16], s % GATE_UP_CLUSTER);
        }
        cluster_arrive();  // done with the neighbours' shared memory (the matching wait is before the exit)
        const float* all_logits = gathered;
#else
        const float* all_logits = own_logits;
#endif
        __syncthreads();
        top_k(all_logits, cand_v, cand_e, ids, chosen);
        if (blockIdx.x == 0 && warp == 0) {
            const float w = threadIdx.x < TOP_K ? expf(chosen[threadIdx.x] - chosen[0]) : 0.f;
            const float total = warp_sum(w);
            if (threadIdx.x < TOP_K) route_ids[threadIdx.x] = ids[threadIdx.x], route_w[threadIdx.x] = w / total;
            __threadfence();
            __syncwarp();
            if (threadIdx.x == 0) store_release(route_ready, 1u);
        }
    }
    const Q4 mg = routed ? gate : shared_gate, mu = routed ? up : shared_up;
    const int row0 = routed ? ids[slot] * MOE_INTER + i0 : i0;
    typename Lane::Tile tg[TPW], tu[TPW];
#pragma unroll
    for (int i = 0; i < TPW; i++) {
        tg[i] = lane.load<true>(mg, row0, 1 << 30, kpart * TPW + i);
        tu[i] = lane.load<true>(mu, row0, 1 << 30, kpart * TPW + i);
    }
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
#if GATE_UP_CLUSTER > 1
    if (routed) cluster_wait();
#endif
}

// hidden[r] += sum_slot weight_slot * (down_e[r] . act[slot]): a block takes 16 rows, one warp a slot; each warp
// stages its own slot's input. The rows are requested before the wait: the shared expert's at once, the routed
// ones when experts_gate_up has published the routing.
extern "C" __global__ void __launch_bounds__(MOE_SLOTS * WARP) experts_down(const float* act, const int* route_ids,
                                                                       const float* route_w, const u32* route_ready,
                                                                       Q4 down, Q4 shared_down, float* hidden) {
    typedef StripLane<MOE_INTER> Lane;
    constexpr int TILES = MOE_INTER / MV_TILE;
    __shared__ StagedX<MOE_INTER> st[MOE_SLOTS];
    __shared__ float part[MOE_SLOTS][16];
    const int slot = threadIdx.x / WARP;
    Lane lane;
    lane.init(st[slot]);
    typename Lane::Tile tiles[TILES];
    auto load = [&](Q4 m, int row0) {
#pragma unroll
        for (int j = 0; j < TILES; j++) tiles[j] = lane.load<true>(m, row0, 1 << 30, j);
    };
    if (slot == TOP_K) {
        load(shared_down, blockIdx.x * 16);
    } else {
        while (load_acquire(route_ready) == 0) __nanosleep(100);
        load(down, load_relaxed(route_ids + slot) * HIDDEN + blockIdx.x * 16);
    }
    wait_previous();
    const float old = threadIdx.x < 16 ? hidden[blockIdx.x * 16 + threadIdx.x] : 0.f;
    const float weight = route_w[slot];
    Stager<MOE_INTER, 1, PlainInput>{PlainInput{act + slot * MOE_INTER}}.stage(st[slot], 0);
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
        for (int k = 0; k < MOE_SLOTS; k++) s += part[k][threadIdx.x];
        hidden[blockIdx.x * 16 + threadIdx.x] = old + s;
    }
}

// Block sizes of the gate/up and down launches; the host sizes grids with them.
extern "C" __device__ const int pairs_per_block = GATE_UP_PAIRS;
extern "C" __device__ const int gate_up_threads = MV_THREADS;
extern "C" __device__ const int down_rows_per_block = 16;
