// The lm_head with the greedy choice fused in (each block's best row, the last block to finish picks the
// overall best), and the sampler for temperature / top-k / top-p / min-p.

// logits = lm_head . rmsnorm(hidden); next_token = argmax (lowest index among equals).
extern "C" __global__ void __launch_bounds__(MV_THREADS, 3) lm_head(const float* hidden, const float* norm, Q4 w,
                                                                 float* logits, float* block_best, int* block_arg,
                                                                 unsigned* blocks_done, int* next_token) {
    typedef Matvec<HIDDEN, MV_KSPLIT_HIDDEN> M;
    __shared__ typename M::Shared sh;
    __shared__ float warp_best[MV_THREADS / WARP];
    __shared__ int warp_arg[MV_THREADS / WARP];
    __shared__ bool is_last;
    // The logits, and this thread's best of the rows it stores.
    struct BestOut {
        float* logits;
        float best;
        int arg;
        __device__ __forceinline__ float before(int) const { return 0.f; }
        __device__ __forceinline__ void store(int r, float dot, float sum_sq, float) {
            const float v = dot * rms_inv(sum_sq, HIDDEN);
            logits[r] = v;
            if (RANKS_BEFORE(v, r, best, arg)) best = v, arg = r;
        }
    };
    Stager<HIDDEN, M::WARPS, NormedInput> stager{NormedInput{hidden, norm}};
    BestOut to{logits, -INF_F, 0x7fffffff};
    M::run(sh, w, VOCAB, stager, to);
    float best = to.best;
    int arg = to.arg;
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    auto reduce_best = [&]() {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ob = __shfl_xor_sync(0xffffffffu, best, o);
            const int oa = __shfl_xor_sync(0xffffffffu, arg, o);
            if (RANKS_BEFORE(ob, oa, best, arg)) best = ob, arg = oa;
        }
    };
    reduce_best();
    if (lane == 0) warp_best[warp] = best, warp_arg[warp] = arg;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int i = 1; i < MV_THREADS / WARP; i++)
            if (RANKS_BEFORE(warp_best[i], warp_arg[i], best, arg)) best = warp_best[i], arg = warp_arg[i];
        block_best[blockIdx.x] = best;
        block_arg[blockIdx.x] = arg;
        __threadfence();
        is_last = atomicAdd(blocks_done, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!is_last) return;
    best = -INF_F;
    arg = 0x7fffffff;
    for (int b = threadIdx.x; b < gridDim.x; b += blockDim.x) {
        const float v = __ldcg(block_best + b);
        const int a = __ldcg(block_arg + b);
        if (RANKS_BEFORE(v, a, best, arg)) best = v, arg = a;
    }
    reduce_best();
    __syncthreads();
    if (lane == 0) warp_best[warp] = best, warp_arg[warp] = arg;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int i = 1; i < MV_THREADS / WARP; i++)
            if (RANKS_BEFORE(warp_best[i], warp_arg[i], best, arg)) best = warp_best[i], arg = warp_arg[i];
        *next_token = arg;
        *blocks_done = 0;
    }
}

// Larger float, larger key.
__device__ __forceinline__ u32 order_key(float f) {
    const u32 b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

#define SAMPLE_THREADS 1024
// One block. Candidates: the `candidates` (<= SAMPLE_MAX_CANDIDATES) highest logits, found by a radix select.
// With top_k in 1..=SAMPLE_MAX_CANDIDATES the probabilities are the softmax over the top-k (as on the CPU);
// otherwise over the whole vocabulary, and top-p / min-p act on the SAMPLE_MAX_CANDIDATES most likely tokens.
// The uniform draw is hash3(seed, 0, counter), the CPU sampler's stream.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) sample(const float* logits, float temperature,
                                                                    int top_k, float top_p, float min_p, u64 seed,
                                                                    u64 counter, int* next_token) {
    __shared__ u32 hist[256];
    __shared__ u32 prefix, prefix_mask, remaining, taken_above, taken_equal;
    __shared__ float cand_logit[SAMPLE_MAX_CANDIDATES];
    __shared__ int cand_id[SAMPLE_MAX_CANDIDATES];
    __shared__ float sorted_logit[SAMPLE_MAX_CANDIDATES];
    __shared__ int sorted_id[SAMPLE_MAX_CANDIDATES];
    __shared__ float scratch[32];
    const int t = threadIdx.x;
    const bool limited = top_k > 0 && top_k <= SAMPLE_MAX_CANDIDATES;
    const int want = limited ? top_k : SAMPLE_MAX_CANDIDATES;
    if (t == 0) prefix = 0, prefix_mask = 0, remaining = want, taken_above = 0, taken_equal = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = t; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        const u32 pf = prefix, pm = prefix_mask;
        for (int i = t; i < VOCAB; i += blockDim.x) {
            const u32 k = order_key(logits[i]);
            if ((k & pm) == pf) atomicAdd(&hist[(k >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (t == 0) {
            u32 above = 0;
            int digit = 255;
            for (; digit > 0; digit--) {
                if (above + hist[digit] >= remaining) break;
                above += hist[digit];
            }
            remaining -= above;
            prefix |= (u32)digit << shift;
            prefix_mask |= 255u << shift;
        }
        __syncthreads();
    }
    // `prefix` is the key of the want-th largest logit; `remaining` of the logits equal to it are taken.
    const u32 threshold = prefix, equal_wanted = remaining;
    const u32 above_count = want - equal_wanted;
    for (int i = t; i < VOCAB; i += blockDim.x) {
        const u32 k = order_key(logits[i]);
        if (k > threshold) {
            const u32 at = atomicAdd(&taken_above, 1u);
            cand_logit[at] = logits[i], cand_id[at] = i;
        } else if (k == threshold) {
            const u32 at = atomicAdd(&taken_equal, 1u);
            if (at < equal_wanted) cand_logit[above_count + at] = logits[i], cand_id[above_count + at] = i;
        }
    }
    __syncthreads();
    if (t < want) {
        const float l = cand_logit[t];
        const int id = cand_id[t];
        int rank = 0;
        for (int j = 0; j < want; j++)
            rank += RANKS_BEFORE(cand_logit[j], cand_id[j], l, id);
        sorted_logit[rank] = l, sorted_id[rank] = id;
    }
    __syncthreads();
    const float mx = sorted_logit[0];
    float z = 0.f;
    if (!limited)
        for (int i = t; i < VOCAB; i += blockDim.x) z += expf((logits[i] - mx) / temperature);
    z = block_sum(z, scratch);
    if (t != 0) return;
    float probs[SAMPLE_MAX_CANDIDATES];
    if (limited) {
        z = 0.f;
        for (int i = 0; i < want; i++) z += expf((sorted_logit[i] - mx) / temperature);
    }
    int keep = want;
    float cumulative = 0.f;
    for (int i = 0; i < want; i++) {
        probs[i] = expf((sorted_logit[i] - mx) / temperature) / z;
        cumulative += probs[i];
        if (top_p < 1.f && cumulative >= top_p && i + 1 < keep) keep = i + 1;
    }
    if (min_p > 0.f) {
        const float floor_p = probs[0] * min_p;
        int k = 0;
        while (k < keep && probs[k] >= floor_p) k++;
        keep = k;
    }
    float kept = 0.f;
    for (int i = 0; i < keep; i++) kept += probs[i];
    float r = uniform_at(seed, 0, counter) * kept;
    int chosen = sorted_id[keep - 1];
    for (int i = 0; i < keep; i++) {
        if (r < probs[i]) { chosen = sorted_id[i]; break; }
        r -= probs[i];
    }
    *next_token = chosen;
}
