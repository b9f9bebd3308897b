// Dense 4-bit matrix-vector products of the decode step, each with its input's preparation fused in front (the
// RMSNorm, or the Gated DeltaNet's gated norm) and its output's use fused behind (a residual add).

// hidden = dequantized row `tokens[position]` of the embedding.
extern "C" __global__ void embed(const int* position, const int* tokens, Q4 table, float* hidden) {
    wait_previous();
    const int token = tokens[*position];
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < HIDDEN; c += gridDim.x * blockDim.x) {
        const u32 word = table.packed[(size_t)token * (HIDDEN / 8) + c / 8];
        const float2 f = pair_to_float2(table.scale_bias[(size_t)token * (HIDDEN / GROUP) + c / GROUP]);
        hidden[c] = f.x * nibble_to_float(word, 4 * (c % 8)) + f.y;
    }
}

// out[r] = W[r] . rmsnorm(hidden) for r < rows (the mixers' input projections, concatenated).
extern "C" __global__ void __launch_bounds__(MV_THREADS, 3) proj_normed(const float* hidden, const float* norm, Q4 w,
                                                                     float* out, int rows) {
    typedef Matvec<HIDDEN, MV_KSPLIT_HIDDEN> M;
    __shared__ typename M::Shared sh;
    Stager<HIDDEN, M::WARPS, NormedInput> stager{NormedInput{hidden, norm}};
    RmsNormedOut to{out};
    M::run(sh, w, rows, stager, to);
}

// hidden[r] += W[r] . gated_norm(core, z): the Gated DeltaNet's output projection. Per value head,
// gated_norm = norm_w * rmsnorm(o) * silu(z); a head is one tile, so its 1 / rms scales that tile's staging.
static_assert(LIN_HEAD_DIM == MV_TILE, "a value head is one tile of the staged input");
struct GatedNormInput {
    const float* core;
    const float* z;
    const float* norm_w;
    typedef float Early;
    typedef float2 Raw;
    __device__ __forceinline__ Early fetch_early(int k) const { return norm_w[k % LIN_HEAD_DIM]; }
    __device__ __forceinline__ Raw fetch(int k) const { return make_float2(core[k], z[k]); }
    __device__ __forceinline__ float2 element(Raw r, Early w) const { return make_float2(r.x * w * siluf_(r.y), r.x * r.x); }
};
struct HeadRmsScale {
    __device__ __forceinline__ float operator()(float sum_sq) const { return rms_inv(sum_sq, LIN_HEAD_DIM); }
};
extern "C" __global__ void __launch_bounds__(MV_THREADS) out_proj_deltanet(const float* core, const float* z,
                                                                      const float* norm_w, Q4 w, float* hidden) {
    typedef Matvec<LIN_V_DIM, MV_KSPLIT_WIDE> M;
    __shared__ typename M::Shared sh;
    Stager<LIN_V_DIM, M::WARPS, GatedNormInput, HeadRmsScale> stager{GatedNormInput{core, z, norm_w}};
    ResidualOut to{hidden};
    M::run(sh, w, HIDDEN, stager, to);
}

// hidden[r] += W[r] . attn: the full attention's output projection (attn already gated).
extern "C" __global__ void __launch_bounds__(MV_THREADS) out_proj_attn(const float* attn, Q4 w, float* hidden) {
    typedef Matvec<Q_DIM, MV_KSPLIT_WIDE> M;
    __shared__ typename M::Shared sh;
    Stager<Q_DIM, M::WARPS, PlainInput> stager{PlainInput{attn}};
    ResidualOut to{hidden};
    M::run(sh, w, HIDDEN, stager, to);
}

extern "C" __global__ void advance_position(int* position) {
    wait_previous();
    *position += 1;
}

// Rows a block of each matrix-vector kernel takes at once; the host sizes grids with them.
extern "C" __device__ const int rows_per_block_hidden = Matvec<HIDDEN, MV_KSPLIT_HIDDEN>::ROWS_PER_BLOCK;
extern "C" __device__ const int rows_per_block_linear_v = Matvec<LIN_V_DIM, MV_KSPLIT_WIDE>::ROWS_PER_BLOCK;
extern "C" __device__ const int rows_per_block_q = Matvec<Q_DIM, MV_KSPLIT_WIDE>::ROWS_PER_BLOCK;
