// Dense 4-bit matrix-vector products of the decode step, each with its input's preparation fused in front (the
// RMSNorm, or the Gated DeltaNet's gated norm) and its output's use fused behind (a residual add).

// hidden = dequantized row `tokens[position]` of the embedding.
extern "C" __global__ void embed(const int* position, const int* tokens, Q4 table, float* hidden) {
    begin_dependent();
    const int token = tokens[*position];
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < HIDDEN; c += gridDim.x * blockDim.x) {
        const u32 word = table.packed[(size_t)token * (HIDDEN / 8) + c / 8];
        const float2 f = pair_to_float2(table.scale_bias[(size_t)token * (HIDDEN / GROUP) + c / GROUP]);
        hidden[c] = f.x * nibble_to_float(word, 4 * (c % 8)) + f.y;
    }
}

// out[r] = W[r] . rmsnorm(hidden) for r < rows (the mixers' input projections, concatenated).
extern "C" __global__ void __launch_bounds__(MV_THREADS) proj_normed(const float* hidden, const float* norm, Q4 w,
                                                                     float* out, int rows) {
    typedef Matvec<HIDDEN, MV_KSPLIT_HIDDEN> M;
    __shared__ float xs[HIDDEN];
    __shared__ typename M::Shared sh;
    __shared__ float scratch[32];
    auto prologue = [&]() { rmsnorm_to_shared<HIDDEN, MV_THREADS>(hidden, norm, xs, scratch); };
    M::run(sh, xs, w, rows, prologue, [&](int r, float v) { out[r] = v; });
}

// hidden[r] += W[r] . gated_norm(core, z): the Gated DeltaNet's output projection. Per value head,
// gated_norm = norm_w * rmsnorm(o) * silu(z).
extern "C" __global__ void __launch_bounds__(MV_THREADS) out_proj_gdn(const float* core, const float* z,
                                                                      const float* norm_w, Q4 w, float* hidden) {
    typedef Matvec<LIN_V_DIM, MV_KSPLIT_WIDE> M;
    __shared__ float xs[LIN_V_DIM];
    __shared__ typename M::Shared sh;
    auto prologue = [&]() {
        constexpr int WARPS = MV_THREADS / WARP;
        constexpr int HEADS = (LIN_V_HEADS + WARPS - 1) / WARPS, PER = LIN_HEAD_DIM / WARP;
        const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
        float o[HEADS][PER], zv[HEADS][PER], nw[PER];
#pragma unroll
        for (int i = 0; i < PER; i++) nw[i] = norm_w[lane + i * WARP];
#pragma unroll
        for (int k = 0; k < HEADS; k++) {
            const int head = min(warp + k * WARPS, LIN_V_HEADS - 1);
#pragma unroll
            for (int i = 0; i < PER; i++) {
                const int c = head * LIN_HEAD_DIM + lane + i * WARP;
                o[k][i] = core[c];
                zv[k][i] = z[c];
            }
        }
#pragma unroll
        for (int k = 0; k < HEADS; k++) {
            const int head = warp + k * WARPS;
            float s = 0.f;
#pragma unroll
            for (int i = 0; i < PER; i++) s += o[k][i] * o[k][i];
            const float inv = 1.f / sqrtf(warp_sum(s) / LIN_HEAD_DIM + RMS_EPS);
            if (head < LIN_V_HEADS) {
#pragma unroll
                for (int i = 0; i < PER; i++) {
                    const int c = head * LIN_HEAD_DIM + lane + i * WARP;
                    xs[c] = o[k][i] * (inv * nw[i]) * siluf_(zv[k][i]);
                }
            }
        }
        __syncthreads();
    };
    M::run(sh, xs, w, HIDDEN, prologue, [&](int r, float v) { hidden[r] += v; });
}

// hidden[r] += W[r] . attn: the full attention's output projection (attn already gated).
extern "C" __global__ void __launch_bounds__(MV_THREADS) out_proj_attn(const float* attn, Q4 w, float* hidden) {
    typedef Matvec<Q_DIM, MV_KSPLIT_WIDE> M;
    __shared__ typename M::Shared sh;
    M::run(sh, attn, w, HIDDEN, [] {}, [&](int r, float v) { hidden[r] += v; });
}

extern "C" __global__ void advance_position(int* position) {
    begin_dependent();
    *position += 1;
}

// Rows a block of each matrix-vector kernel takes at once; the host sizes grids with them.
extern "C" __device__ const int rows_per_block_hidden = Matvec<HIDDEN, MV_KSPLIT_HIDDEN>::ROWS_PER_BLOCK;
extern "C" __device__ const int rows_per_block_lin_v = Matvec<LIN_V_DIM, MV_KSPLIT_WIDE>::ROWS_PER_BLOCK;
extern "C" __device__ const int rows_per_block_q = Matvec<Q_DIM, MV_KSPLIT_WIDE>::ROWS_PER_BLOCK;
