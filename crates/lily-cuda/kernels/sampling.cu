// The lm_head with the greedy choice fused in (each block's best row, the last block to finish picks the
// overall best), and the sampler of a batch's rows (temperature / top-k / top-p / min-p and a token mask).

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
            if (RANKS_BEFORE(rank_value(v), r, best, arg)) best = rank_value(v), arg = r;
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

// Larger float, larger key: the order of f32::total_cmp (-0 before +0, NaNs outside the infinities).
__device__ __forceinline__ u32 order_key(float f) {
    const u32 b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// One row's sampling parameters: the twin of lily_cuda::kernels::sampling::RowParams (#[repr(C)], 40 bytes).
struct SampleRow {
    // 0: greedy (the host sends 0 whenever SamplingParams::is_greedy holds).
    float temperature;
    int top_k;
    float top_p;
    float min_p;
    u64 seed;
    // The draw's index in the sequence's random stream: the uniform is hash3(seed, 0, counter).
    u64 counter;
    // The row of the mask buffer that allows this row's tokens, or -1 for no mask.
    int mask_row;
    // The row of `logits` this row draws from.
    int logits_row;
};

#define SAMPLE_THREADS 1024
// WHOLE_RUN (a -D define from lily_model::sampling::WHOLE_RUN): tokens a run of the whole-vocabulary sums, a
// thread a run.
#define WHOLE_RUNS ((VOCAB + WHOLE_RUN - 1) / WHOLE_RUN)
static_assert(WHOLE_RUNS <= SAMPLE_THREADS, "a thread sums a run");
// SAMPLE_HEAD (a -D define from lily_model::sampling::HEAD): the candidate slots, so the largest top-k drawn here,
// and the most likely tokens a top-p or min-p draw without a top-k looks among; where what they keep does not end
// inside them, the row is left to the host, which looks further.
static_assert(SAMPLE_HEAD <= SAMPLE_THREADS, "a thread a candidate when they are ranked");
// u32 words of one allowed-token bitmask: bit t % 32 of word t / 32 allows token t.
#define MASK_WORDS ((VOCAB + 31) / 32)

// Logit `i` of a row after its mask: a token the mask does not allow is negative infinity.
__device__ __forceinline__ float allowed_logit(const float* row, const u32* mask, int i) {
    const float l = row[i];
    return (mask == nullptr || ((mask[i >> 5] >> (i & 31)) & 1u)) ? l : -INF_F;
}

// A candidate's key: the scaled logit's order key above, VOCAB - 1 - id below. A larger key ranks before (the
// larger value, then the lower id, as the CPU sampler's sort), and no two tokens share a key.
__device__ __forceinline__ u64 candidate_key(float scaled, int i) {
    return ((u64)order_key(scaled) << 32) | (u32)(VOCAB - 1 - i);
}

// The largest allowed logit's id (the lowest id among equals), as lily_model::sampling::argmax over the masked row.
__device__ int row_argmax(const float* row, const u32* mask, float* warp_best, int* warp_arg) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    float best = -INF_F;
    int arg = 0x7fffffff;
    for (int i = threadIdx.x; i < VOCAB; i += blockDim.x) {
        const float v = rank_value(allowed_logit(row, mask, i));
        if (RANKS_BEFORE(v, i, best, arg)) best = v, arg = i;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ob = __shfl_xor_sync(0xffffffffu, best, o);
        const int oa = __shfl_xor_sync(0xffffffffu, arg, o);
        if (RANKS_BEFORE(ob, oa, best, arg)) best = ob, arg = oa;
    }
    if (lane == 0) warp_best[warp] = best, warp_arg[warp] = arg;
    __syncthreads();
    if (threadIdx.x == 0)
        for (int w = 1; w < (int)(blockDim.x / WARP); w++)
            if (RANKS_BEFORE(warp_best[w], warp_arg[w], best, arg)) best = warp_best[w], arg = warp_arg[w];
    return arg;
}

// A token's weight in the softmax of a row's scaled logits: exp(scaled - mx), in double rounded to float (as the
// CPU's f32 exp gives it), mx the largest scaled logit.
__device__ __forceinline__ float softmax_weight(const float* row, const u32* mask, int i, float temperature, float mx) {
    const float l = allowed_logit(row, mask, i);
    return (float)exp((double)__fsub_rn(temperature == 1.f ? l : l / temperature, mx));
}

// The sum of every token's softmax_weight as lily_model::sampling sums them: in double over runs of WHOLE_RUN tokens
// in order (a thread a run here), then the runs' sums in order; run_sums[b] is run b's. Every thread of the block
// calls it and gets the total.
__device__ double softmax_total(const float* row, const u32* mask, float temperature, float mx, double* run_sums) {
    __shared__ double total;
    const int t = threadIdx.x;
    if (t < WHOLE_RUNS) {
        double sum = 0.0;
        const int end = min(VOCAB, (t + 1) * WHOLE_RUN);
        for (int i = t * WHOLE_RUN; i < end; i++) sum += (double)softmax_weight(row, mask, i, temperature, mx);
        run_sums[t] = sum;
    }
    __syncthreads();
    if (t == 0) {
        double sum = 0.0;
        for (int b = 0; b < WHOLE_RUNS; b++) sum += run_sums[b];
        total = sum;
    }
    __syncthreads();
    return total;
}

// The draw of a row with nothing cut off (no top-k, top-p or min-p) from the softmax of all its scaled logits, as
// lily_model::sampling::Sampler::sample_whole draws it: the uniform times softmax_total walks the runs in order,
// then the chosen run's weights. A walk that runs past the end (rounding) takes the argmax. Every thread of the
// block calls it; thread 0's is the token.
__device__ int sample_whole_row(const float* row, const u32* mask, float temperature, float mx, float u,
                                double* run_sums, float* warp_best, int* warp_arg) {
    __shared__ float weights[WHOLE_RUN];
    __shared__ int chosen_run, chosen;
    __shared__ double rest;
    const int t = threadIdx.x;
    const double total = softmax_total(row, mask, temperature, mx, run_sums);
    if (t == 0) {
        // Rounded operations throughout, as the CPU's (never contracted into a fused multiply-add).
        double r = __dmul_rn((double)u, total);
        chosen_run = -1, chosen = -1;
        for (int b = 0; b < WHOLE_RUNS; b++) {
            if (r < run_sums[b]) {
                chosen_run = b;
                break;
            }
            r = __dsub_rn(r, run_sums[b]);
        }
        rest = r;
    }
    __syncthreads();
    const int b = chosen_run;
    if (b >= 0) {
        const int i = b * WHOLE_RUN + t;
        if (t < WHOLE_RUN && i < VOCAB) weights[t] = softmax_weight(row, mask, i, temperature, mx);
        __syncthreads();
        if (t == 0) {
            double r = rest;
            const int n = min(WHOLE_RUN, VOCAB - b * WHOLE_RUN);
            for (int j = 0; j < n; j++) {
                const double w = (double)weights[j];
                if (r < w) {
                    chosen = b * WHOLE_RUN + j;
                    break;
                }
                r = __dsub_rn(r, w);
            }
        }
        __syncthreads();
    }
    if (chosen >= 0) return chosen;
    return row_argmax(row, mask, warp_best, warp_arg);
}

// One block per row r of `rows`: the next token drawn from logits row `rows[r].logits_row` (`logits` is
// [*][VOCAB]) with the row's parameters and its allowed-token bitmask (row `mask_row` of `masks`, [*][MASK_WORDS])
// applied before anything else, into `out[r]`.
// The draw is the CPU sampler's (lily_model::sampling::Sampler) step by step: greedy is the argmax; otherwise the
// logits are divided by the temperature, the top_k (1..=SAMPLE_HEAD) largest are found by a radix select
// over the candidate keys, sorted, turned into probabilities (exp in double rounded to float, a double total),
// cut by top-p then min-p, and the uniform hash3(seed, 0, counter) picks among them with the CPU's f32 arithmetic.
// A row with no top-k (0, or the whole vocabulary), top-p or min-p draws from the whole softmax (sample_whole_row).
// A row with top-p or min-p but no top-k takes the SAMPLE_HEAD most likely tokens as its candidates and the whole
// softmax's total (softmax_total), as the CPU sampler does when what top-p and min-p keep ends inside its first
// head; where it does not, the row is left to the host. A row with a top_k beyond SAMPLE_HEAD is too.
// A row left to the host has out -1.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_rows(const float* logits, const SampleRow* rows, const u32* masks, int* out) {
    wait_previous();
    __shared__ u32 hist[256];
    __shared__ u64 prefix, prefix_mask;
    __shared__ u32 remaining, taken;
    __shared__ bool resolved;
    __shared__ u64 cand_key[SAMPLE_HEAD];
    __shared__ float cand_scaled[SAMPLE_HEAD];
    __shared__ float sorted_scaled[SAMPLE_HEAD];
    __shared__ int sorted_id[SAMPLE_HEAD];
    __shared__ double run_sums[WHOLE_RUNS];
    __shared__ float warp_best[SAMPLE_THREADS / WARP];
    __shared__ int warp_arg[SAMPLE_THREADS / WARP];
    const int t = threadIdx.x, r = blockIdx.x;
    const SampleRow p = rows[r];
    const float* row = logits + (size_t)p.logits_row * VOCAB;
    const u32* mask = p.mask_row >= 0 ? masks + (size_t)p.mask_row * MASK_WORDS : nullptr;
    if (p.temperature <= 0.f) {
        const int arg = row_argmax(row, mask, warp_best, warp_arg);
        if (t == 0) out[r] = arg;
        return;
    }
    const bool no_top_k = p.top_k == 0 || p.top_k >= VOCAB;
    const bool whole = no_top_k && p.top_p >= 1.f && p.min_p <= 0.f, nucleus = no_top_k && !whole;
    if (!no_top_k && (p.top_k < 1 || p.top_k > SAMPLE_HEAD)) {
        if (t == 0) out[r] = -1;
        return;
    }
    const float temperature = p.temperature;
    const bool unit = temperature == 1.f;
    // The CPU sampler's scaled logit, logit / temperature (IEEE division, as on the CPU).
    auto scaled_at = [&](int i) {
        const float l = allowed_logit(row, mask, i);
        return unit ? l : l / temperature;
    };
    // Without a top-k: the largest scaled logit (f32::max over them on the CPU: NaN is passed over, as by fmaxf)
    // and the softmax's total over the whole vocabulary.
    double whole_total = 0.0;
    if (no_top_k) {
        float mx = -INF_F;
        for (int i = t; i < VOCAB; i += blockDim.x) mx = fmaxf(mx, scaled_at(i));
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        if (t % WARP == 0) warp_best[t / WARP] = mx;
        __syncthreads();
        mx = -INF_F;
        for (int w = 0; w < (int)(blockDim.x / WARP); w++) mx = fmaxf(mx, warp_best[w]);
        __syncthreads();  // warp_best is reused by the argmax
        if (mx == INF_F || whole) {
            const int drawn = mx == INF_F ? row_argmax(row, mask, warp_best, warp_arg)
                                          : sample_whole_row(row, mask, temperature, mx,
                                                             uniform_at(p.seed, 0, p.counter), run_sums, warp_best,
                                                             warp_arg);
            if (t == 0) out[r] = drawn;
            return;
        }
        whole_total = softmax_total(row, mask, temperature, mx, run_sums);
    }
    const int want = min(nucleus ? SAMPLE_HEAD : p.top_k, VOCAB);
    // Radix select, 8 bits a pass from the top: `prefix` narrows to the bucket that holds the want-th largest key,
    // and stops as soon as that bucket is taken whole (at the latest when one key remains).
    if (t == 0) prefix = 0, prefix_mask = 0, remaining = want, taken = 0, resolved = false;
    for (int shift = 56; shift >= 0; shift -= 8) {
        for (int i = t; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        const u64 pf = prefix, pm = prefix_mask;
        for (int i = t; i < VOCAB; i += blockDim.x) {
            const u64 k = candidate_key(scaled_at(i), i);
            if ((k & pm) == pf) atomicAdd(&hist[(u32)(k >> shift) & 255u], 1u);
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
            prefix |= (u64)digit << shift;
            prefix_mask |= 255ull << shift;
            resolved = hist[digit] == remaining;
        }
        __syncthreads();
        if (resolved) break;
    }
    // The want keys at or above the prefix, in any order, then sorted by rank.
    const u64 pf = prefix, pm = prefix_mask;
    for (int i = t; i < VOCAB; i += blockDim.x) {
        const float s = scaled_at(i);
        const u64 k = candidate_key(s, i);
        if ((k & pm) >= pf) {
            const u32 at = atomicAdd(&taken, 1u);
            if (at < (u32)want) cand_key[at] = k, cand_scaled[at] = s;
        }
    }
    __syncthreads();
    if (t < want) {
        const u64 k = cand_key[t];
        int rank = 0;
        for (int j = 0; j < want; j++) rank += cand_key[j] > k;
        sorted_scaled[rank] = cand_scaled[t];
        sorted_id[rank] = VOCAB - 1 - (int)(u32)k;
    }
    __syncthreads();
    const float mx = sorted_scaled[0];
    // A temperature so small that the division overflows: the CPU sampler takes the argmax then.
    if (mx == INF_F) {
        const int arg = row_argmax(row, mask, warp_best, warp_arg);
        if (t == 0) out[r] = arg;
        return;
    }
    __syncthreads();  // every thread has read mx before thread 0 overwrites sorted_scaled
    if (t != 0) return;
    // Thread 0 alone from here: the sorted candidates turn into their probabilities in place (arrays of its own
    // would be 2 KB of stack a thread, which the driver reserves for every thread the GPU can hold).
    float* probs = sorted_scaled;
    int* ids = sorted_id;
    double total = 0.0;
    for (int i = 0; i < want; i++) {
        probs[i] = (float)exp((double)__fsub_rn(probs[i], mx));
        total += (double)probs[i];
    }
    if (nucleus) total = whole_total;  // the candidates' probabilities are their share of the whole softmax
    for (int i = 0; i < want; i++) probs[i] = (float)((double)probs[i] / total);
    if (nucleus && want < VOCAB) {
        // The CPU sampler's test that what top-p and min-p keep ends inside the head (its holds_kept).
        bool top_p_inside = p.top_p >= 1.f, min_p_inside = p.min_p <= 0.f;
        float cumulative = 0.f;
        for (int i = 0; i < want && !top_p_inside; i++) {
            cumulative = __fadd_rn(cumulative, probs[i]);
            top_p_inside = cumulative >= p.top_p;
        }
        if (!min_p_inside) min_p_inside = probs[want - 1] < __fmul_rn(probs[0], p.min_p);
        const bool held = p.top_p < 1.f && p.min_p > 0.f ? top_p_inside || min_p_inside
                                                          : top_p_inside && min_p_inside;
        if (!held) {
            out[r] = -1;
            return;
        }
    }
    int keep = want;
    if (p.top_p < 1.f) {
        float cumulative = 0.f;
        for (int i = 0; i < want; i++) {
            cumulative = __fadd_rn(cumulative, probs[i]);
            if (cumulative >= p.top_p) {
                keep = i + 1;
                break;
            }
        }
    }
    if (p.min_p > 0.f) {
        const float floor_p = __fmul_rn(probs[0], p.min_p);
        int k = 0;
        for (int i = 0; i < keep; i++)
            if (probs[i] >= floor_p) probs[k] = probs[i], ids[k] = ids[i], k++;
        keep = k;
    }
    float kept = 0.f;
    for (int i = 0; i < keep; i++) kept = __fadd_rn(kept, probs[i]);
    float u = __fmul_rn(uniform_at(p.seed, 0, p.counter), kept);
    int chosen = ids[keep - 1];
    for (int i = 0; i < keep; i++) {
        if (u < probs[i]) {
            chosen = ids[i];
            break;
        }
        u = __fsub_rn(u, probs[i]);
    }
    out[r] = chosen;
}
