// One decode step of a Gated DeltaNet layer, fused: the causal conv update of the new q/k/v input, SiLU, the
// l2-norms, the gates and the delta-rule update of the state (stored as f16, updated in f32). The single sequence's
// step writes the raw output o (the gated RMSNorm is applied in front of the output projection, which needs the
// whole head); the batched step, whose block holds a whole head, applies the gated RMSNorm itself.
//
// Grid (value heads, SPLIT, rows): a block owns DV / SPLIT state columns of one value head (the columns of the
// recurrence are independent) for batch row blockIdx.z; a thread holds two adjacent columns (one 32-bit word of each
// state row it owns), so a warp reads and writes 128 contiguous bytes of a row. Row b is a token of the sequence in
// slot slots[b] at position positions[b]: its proj row is proj + b * DN_PROJ_ROW, its output row core + b *
// LIN_V_DIM, and its state is the slot's (slot s at s times the size of one sequence's ring and recurrent state).
// The conv keeps the last CONV_K inputs in a ring indexed by position % CONV_K, so the ring row written this step is
// one no block reads this step.
//
// Two instances: `deltanet_step` for one sequence cuts a head into DELTANET_SPLIT = 4 blocks (128 blocks a layer,
// about one per SM); `deltanet_step_rows` for a batched step, whose rows already fill the GPU, takes a whole head a
// block and stages its 32 KB of state in shared memory (cp.async, issued before the wait for the previous kernel):
// the step streams the state, and with 40 registers a thread six blocks fit an SM, which keep more of it in flight
// while others compute. Holding the whole head, it also ends with the head's gated RMSNorm (and, for the output
// projection's integer small tiling, the Q8x2 codes of the result), so the batched step needs no separate norm.

#ifndef DELTANET_SPLIT
#define DELTANET_SPLIT 4
#endif
#define DELTANET_THREADS 256
#define DK LIN_HEAD_DIM
#define DV LIN_HEAD_DIM
#define DN_PROJ_ROW (LIN_CONV_DIM + LIN_V_DIM + 2 * LIN_V_HEADS)
#define DN_STATE_SIZE ((size_t)LIN_V_HEADS * DK * DV)
#define DN_RING_SIZE ((size_t)CONV_K * LIN_CONV_DIM)
static_assert(2 * DK == DELTANET_THREADS, "one thread per q/k channel of the key head");

// Read by the host (the grids' y dimension).
__device__ int deltanet_split = DELTANET_SPLIT;

// The conv taps of channel c that come from earlier steps (ring slots other than position % CONV_K, which this
// step writes) and the channel's conv weights: all independent of this step's earlier kernels.
struct ConvTaps {
    float past[CONV_K - 1], w[CONV_K];
    __device__ __forceinline__ void load(const float* ring, const float* conv_w, int c, int position) {
#pragma unroll
        for (int j = 0; j < CONV_K; j++) w[j] = conv_w[c * CONV_K + j];
#pragma unroll
        for (int j = 0; j < CONV_K - 1; j++) past[j] = ring[((position + 1 + j) % CONV_K) * LIN_CONV_DIM + c];
    }
    __device__ __forceinline__ float silu_conv(float current) const {
        float acc = w[CONV_K - 1] * current;
#pragma unroll
        for (int j = 0; j < CONV_K - 1; j++) acc += w[j] * past[j];
        return siluf_(acc);
    }
};

// proj: [q k v (LIN_CONV_DIM) | z (LIN_V_DIM) | b (LIN_V_HEADS) | a (LIN_V_HEADS)]. What does not depend on this
// step's input projection (the state, the conv taps and weights, the position) is requested before the wait.
// SPLIT 1 with `normed` not null: instead of the raw output into `core`, the row's gated RMSNorm of the head,
// bf16(norm_w[j] * rmsnorm(o)[j] * silu(z[j])) (z at column LIN_CONV_DIM of the proj row), into `normed` (LIN_V_DIM
// columns a row), and where `codes.codes` is not null also as Q8x2 codes, what gemm_quantize_rows would make of it.
template <int SPLIT>
__device__ __forceinline__ void deltanet_step_split(const int* positions, const int* slots, const float* proj,
                                                    float* ring, const float* conv_w, const float* a_log,
                                                    const float* dt_bias, f16* state, float* core,
                                                    const float* norm_w, bf16* normed, Q8x2 codes) {
    constexpr int COLS_PER_BLOCK = DV / SPLIT;
    constexpr int PAIRS = COLS_PER_BLOCK / 2;
    constexpr int ROW_GROUPS = DELTANET_THREADS / PAIRS;
    constexpr int ROWS_PER_THREAD = DK / ROW_GROUPS;
    static_assert(DV % SPLIT == 0 && COLS_PER_BLOCK % 2 == 0 && DK % ROW_GROUPS == 0, "state columns and rows split evenly");
    __shared__ float q[DK], k[DK];
    __shared__ float v[COLS_PER_BLOCK];
    __shared__ float red[ROW_GROUPS][COLS_PER_BLOCK];
    __shared__ float sums[2][WARP];
    const int row = blockIdx.z;
    const int position = positions[row], seq = slots[row];
    proj += (size_t)row * DN_PROJ_ROW;
    core += (size_t)row * LIN_V_DIM;
    ring += seq * DN_RING_SIZE;
    state += seq * DN_STATE_SIZE;
    const int head = blockIdx.x, key_head = head / (LIN_V_HEADS / LIN_K_HEADS);
    const int col0 = blockIdx.y * COLS_PER_BLOCK;
    const int t = threadIdx.x, lane = t % WARP, warp = t / WARP;
    const bool owns_qk_ring = blockIdx.y == 0 && head % (LIN_V_HEADS / LIN_K_HEADS) == 0;
    const int c_qk = t < DK ? key_head * DK + t : LIN_K_DIM + key_head * DK + (t - DK);
    const int c_v = 2 * LIN_K_DIM + head * DV + col0 + t % COLS_PER_BLOCK;

    // State columns col0 + j, j + 1 (j = 2 * (t % PAIRS)), rows i0 .. i0 + ROWS_PER_THREAD.
    const int j = 2 * (t % PAIRS), group = t / PAIRS, i0 = group * ROWS_PER_THREAD;
    u32* s = (u32*)(state + (size_t)head * DK * DV + col0 + j);
    // STAGED (the batched instance: a whole head a block, 32 KB of state) copies the block's state into shared
    // memory with cp.async instead of holding it in registers: the registers then allow several blocks an SM, so
    // more of the state is in flight while other blocks compute. The split instance holds its rows in registers.
    constexpr bool STAGED = SPLIT == 1;
    constexpr int STAGED_WORDS = STAGED ? DK * COLS_PER_BLOCK / 2 : 1;
    __shared__ __align__(16) u32 staged[STAGED_WORDS];
    float2 col[STAGED ? 1 : ROWS_PER_THREAD];
    if constexpr (STAGED) {
        static_assert(COLS_PER_BLOCK == DV && STAGED_WORDS % (4 * DELTANET_THREADS) == 0, "whole rows, 16 bytes a copy");
        const u32* head_state = (const u32*)(state + (size_t)head * DK * DV);
        const u32 base = (u32)__cvta_generic_to_shared(staged);
#pragma unroll
        for (int c = t; c < STAGED_WORDS / 4; c += DELTANET_THREADS) cp_async_16(base + 16 * c, head_state + 4 * c, 16u);
        cp_async_commit();
    } else {
#pragma unroll
        for (int r = 0; r < ROWS_PER_THREAD; r++) col[r] = f16x2_to_float2(s[(size_t)(i0 + r) * (DV / 2)]);
    }
    // Row r of this thread's two columns times the decay: from shared memory, or from its registers (which the
    // first use below leaves decayed).
    auto decayed = [&](int r, float decay) -> float2 {
        if constexpr (STAGED) {
            const float2 c = f16x2_to_float2(staged[(i0 + r) * (DV / 2) + j / 2]);
            return make_float2(c.x * decay, c.y * decay);
        } else {
            return col[r];
        }
    };
    ConvTaps taps_qk, taps_v;
    taps_qk.load(ring, conv_w, c_qk, position);
    if (t < COLS_PER_BLOCK) taps_v.load(ring, conv_w, c_v, position);
    const float a_log_h = a_log[head], dt_bias_h = dt_bias[head];
    // The gated norm's weights of this thread's two output columns (threads of row group 0 hold the output).
    const bool gated = STAGED && normed != nullptr;
    const float2 norm_w2 = gated && group == 0 ? *(const float2*)&norm_w[j] : make_float2(0.f, 0.f);
    wait_previous();

    // q (threads 0..DK) and k (DK..2DK) of the key head, then their l2-norms (4 warps each).
    const float proj_qk = proj[c_qk];
    const float proj_v = t < COLS_PER_BLOCK ? proj[c_v] : 0.f;
    const float b_in = proj[LIN_CONV_DIM + LIN_V_DIM + head];
    const float a_in = proj[LIN_CONV_DIM + LIN_V_DIM + LIN_V_HEADS + head];
    const float2 z = gated && group == 0 ? *(const float2*)&proj[LIN_CONV_DIM + head * DV + j] : make_float2(0.f, 0.f);
    float x = taps_qk.silu_conv(proj_qk);
    const float sq = warp_sum(x * x);
    if (lane == 0) sums[t / DK][warp % (DK / WARP)] = sq;
    if (t < COLS_PER_BLOCK) v[t] = taps_v.silu_conv(proj_v);
    __syncthreads();
    float total = 0.f;
#pragma unroll
    for (int i = 0; i < DK / WARP; i++) total += sums[t / DK][i];
    x *= 1.f / sqrtf(total + 1e-6f);
    if (t < DK) q[t] = x * (1.f / sqrtf((float)DK));
    else k[t - DK] = x;
    // The new inputs enter the ring; each channel is written by exactly one block.
    const int slot = position % CONV_K;
    if (owns_qk_ring) ring[slot * LIN_CONV_DIM + c_qk] = proj_qk;
    if (t < COLS_PER_BLOCK) ring[slot * LIN_CONV_DIM + c_v] = proj_v;
    const float beta = sigmoidf_(b_in);
    const float decay = expf(-expf(a_log_h) * softplusf_(a_in + dt_bias_h));
    if constexpr (STAGED) cp_async_wait<0>();
    __syncthreads();

    float2 kv = make_float2(0.f, 0.f);
#pragma unroll
    for (int r = 0; r < ROWS_PER_THREAD; r++) {
        if constexpr (!STAGED) col[r].x *= decay, col[r].y *= decay;
        const float2 c = decayed(r, decay);
        kv.x = fmaf(c.x, k[i0 + r], kv.x);
        kv.y = fmaf(c.y, k[i0 + r], kv.y);
    }
    red[group][j] = kv.x;
    red[group][j + 1] = kv.y;
    __syncthreads();
    float2 kv_mem = make_float2(0.f, 0.f);
#pragma unroll
    for (int gi = 0; gi < ROW_GROUPS; gi++) {
        kv_mem.x += red[gi][j];
        kv_mem.y += red[gi][j + 1];
    }
    const float u0 = (v[j] - kv_mem.x) * beta, u1 = (v[j + 1] - kv_mem.y) * beta;
    float2 o = make_float2(0.f, 0.f);
#pragma unroll
    for (int r = 0; r < ROWS_PER_THREAD; r++) {
        float2 c = decayed(r, decay);
        c.x = fmaf(k[i0 + r], u0, c.x);
        c.y = fmaf(k[i0 + r], u1, c.y);
        o.x = fmaf(c.x, q[i0 + r], o.x);
        o.y = fmaf(c.y, q[i0 + r], o.y);
        s[(size_t)(i0 + r) * (DV / 2)] = float2_to_f16x2(c.x, c.y);
    }
    __syncthreads();
    red[group][j] = o.x;
    red[group][j + 1] = o.y;
    __syncthreads();
    float2 out = make_float2(0.f, 0.f);
    if (group == 0) {
#pragma unroll
        for (int gi = 0; gi < ROW_GROUPS; gi++) {
            out.x += red[gi][j];
            out.y += red[gi][j + 1];
        }
    }
    if (!gated) {
        if (group == 0) *(float2*)&core[head * DV + col0 + j] = out;
        return;
    }
    // The head's gated RMSNorm: its DV outputs are on warps 0 and 1 (row group 0), two a thread.
    static_assert(!STAGED || (PAIRS == 2 * WARP && DV == 2 * GROUP && GROUP == 2 * WARP),
                  "row group 0 is two warps, each holding one group of the codes, two columns a lane");
    const float out_sq = warp_sum(out.x * out.x + out.y * out.y);
    if (lane == 0 && warp < 2) sums[0][warp] = out_sq;
    __syncthreads();
    if (group != 0) return;
    const float inv = rms_inv(sums[0][0] + sums[0][1], DV);
    const bf16 y0 = float_to_bf16(out.x * (inv * norm_w2.x) * siluf_(z.x));
    const bf16 y1 = float_to_bf16(out.y * (inv * norm_w2.y) * siluf_(z.y));
    *(u32*)&normed[(size_t)row * LIN_V_DIM + head * DV + j] = (u32)y0 | (u32)y1 << 16;
    if (!codes.codes) return;  // uniform: the output projection does not take the small tiling
    // A word of the codes (8 columns) is on 4 lanes; each of them gathers it whole, and the first writes it.
    const float mine[2] = {bf16_to_float(y0), bf16_to_float(y1)};
    float word_v[8];
#pragma unroll
    for (int q = 0; q < 4; q++) {
        word_v[2 * q] = __shfl_sync(0xffffffffu, mine[0], (lane & ~3) + q);
        word_v[2 * q + 1] = __shfl_sync(0xffffffffu, mine[1], (lane & ~3) + q);
    }
    const size_t word = (size_t)row * (LIN_V_DIM / 8) + head * (DV / 8) + warp * (GROUP / 8) + lane / 4;
    const size_t pair = (size_t)row * (LIN_V_DIM / GROUP) + head * (DV / GROUP) + warp;
    quantize_word_q8x2<4>(word_v, lane / 4, lane % 4 == 0, (uint4*)codes.codes + word, (float2*)codes.pairs + pair);
}

extern "C" __global__ void __launch_bounds__(DELTANET_THREADS)
    deltanet_step(const int* positions, const int* slots, const float* proj, float* ring, const float* conv_w,
                  const float* a_log, const float* dt_bias, f16* state, float* core) {
    deltanet_step_split<DELTANET_SPLIT>(positions, slots, proj, ring, conv_w, a_log, dt_bias, state, core, nullptr,
                                        nullptr, Q8x2{nullptr, nullptr});
}

// Six blocks an SM (their staged state fills its shared memory): at most 40 registers a thread.
#define DELTANET_ROWS_BLOCKS 6
extern "C" __global__ void __launch_bounds__(DELTANET_THREADS, DELTANET_ROWS_BLOCKS)
    deltanet_step_rows(const int* positions, const int* slots, const float* proj, float* ring, const float* conv_w,
                       const float* a_log, const float* dt_bias, f16* state, float* core, const float* norm_w,
                       bf16* normed, Q8x2 codes) {
    deltanet_step_split<1>(positions, slots, proj, ring, conv_w, a_log, dt_bias, state, core, norm_w, normed, codes);
}
