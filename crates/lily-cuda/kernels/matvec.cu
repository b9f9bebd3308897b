// Dense 4-bit matrix-vector products of the decode step, each with its input's preparation fused in front (the
// RMSNorm, or the Gated DeltaNet's gated norm) and its output's use fused behind (a residual add).

// hidden = dequantized row `tokens[position]` of the embedding.
extern "C" __global__ void embed(const int* position, const int* tokens, Q4 table, float* hidden) {
    const int token = tokens[*position];
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < HIDDEN; c += gridDim.x * blockDim.x) {
        const u32 word = table.packed[(size_t)token * (HIDDEN / 8) + c / 8];
        const float2 f = __bfloat1622float2(table.scale_bias[(size_t)token * (HIDDEN / GROUP) + c / GROUP]);
        hidden[c] = f.x * nibble_to_float(word, 4 * (c % 8)) + f.y;
    }
}

// out[r] = W[r] . rmsnorm(hidden) for r < rows (the mixers' input projections, concatenated).
extern "C" __global__ void __launch_bounds__(MV_THREADS) proj_normed(const float* hidden, const float* norm, Q4 w,
                                                                     float* out, int rows) {
    typedef Matvec<HIDDEN> M;
    __shared__ float xs[HIDDEN];
    __shared__ float acc[M::ROWS_PER_BLOCK];
    __shared__ float scratch[32];
    const float inv = rms_inv(hidden, HIDDEN, scratch);
    STORE_SWIZZLED(xs, HIDDEN, hidden[c] * inv * norm[c]);
    __syncthreads();
    M::run(xs, w, rows, acc, [&](int r, float v) { out[r] = v; });
}

// hidden[r] += W[r] . gated_norm(core, z): the Gated DeltaNet's output projection. Per value head,
// gated_norm = norm_w * rmsnorm(o) * silu(z).
extern "C" __global__ void __launch_bounds__(MV_THREADS) out_proj_gdn(const float* core, const float* z,
                                                                      const float* norm_w, Q4 w, float* hidden) {
    typedef Matvec<LIN_V_DIM> M;
    __shared__ float xs[LIN_V_DIM];
    __shared__ float acc[M::ROWS_PER_BLOCK];
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    for (int head = warp; head < LIN_V_HEADS; head += MV_THREADS / WARP) {
        const float* o = core + head * LIN_HEAD_DIM;
        float s = 0.f;
        for (int d = lane; d < LIN_HEAD_DIM; d += WARP) s += o[d] * o[d];
        const float inv = 1.f / sqrtf(warp_sum(s) / LIN_HEAD_DIM + RMS_EPS);
        for (int d = lane; d < LIN_HEAD_DIM; d += WARP) {
            const int c = head * LIN_HEAD_DIM + d;
            xs[swz(c)] = o[d] * (inv * norm_w[d]) * siluf_(z[c]);
        }
    }
    __syncthreads();
    M::run(xs, w, HIDDEN, acc, [&](int r, float v) { hidden[r] += v; });
}

// hidden[r] += W[r] . attn: the full attention's output projection (attn already gated).
extern "C" __global__ void __launch_bounds__(MV_THREADS) out_proj_attn(const float* attn, Q4 w, float* hidden) {
    typedef Matvec<Q_DIM> M;
    __shared__ float xs[Q_DIM];
    __shared__ float acc[M::ROWS_PER_BLOCK];
    STORE_SWIZZLED(xs, Q_DIM, attn[c]);
    __syncthreads();
    M::run(xs, w, HIDDEN, acc, [&](int r, float v) { hidden[r] += v; });
}

extern "C" __global__ void advance_position(int* position) { *position += 1; }

// Rows a block of each matrix-vector kernel takes at once; the host sizes grids with them.
extern "C" __device__ const int rows_per_block_hidden = Matvec<HIDDEN>::ROWS_PER_BLOCK;
extern "C" __device__ const int rows_per_block_lin_v = Matvec<LIN_V_DIM>::ROWS_PER_BLOCK;
extern "C" __device__ const int rows_per_block_q = Matvec<Q_DIM>::ROWS_PER_BLOCK;
