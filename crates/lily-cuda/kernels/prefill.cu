// Prefill glue around the matrix products (gemm.cu): the chunk's embedding rows, RMSNorm rows into the bf16 input
// of the next product, the router's logits, every token's routing, a stable counting sort of the (token, slot)
// entries by expert with the tile list of the grouped expert products, and the MoE's combine into the residual
// stream (on its own, or inside the next RMSNorm).

#define ROW_THREADS 256
#define SORT_THREADS 256

// Column c of row r's MoE output: the sum over its slots of expert_out[r * MOE_SLOTS + slot] (each already
// weighted and rounded to bf16, as transformers keeps each expert's rows; the shared expert's last), in slot order
// in f32.
__device__ __forceinline__ float combined_experts(const bf16* expert_out, size_t r, int c) {
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < MOE_SLOTS; k++) s += bf16_to_float(expert_out[(r * MOE_SLOTS + k) * HIDDEN + c]);
    return s;
}

// Four consecutive bf16 values, packed as a load leaves them, as f32.
__device__ __forceinline__ float4 bf16x4_to_float4(uint2 raw) {
    const float2 a = pair_to_float2(raw.x), b = pair_to_float2(raw.y);
    return make_float4(a.x, a.y, b.x, b.y);
}

// hidden[r] = the dequantized embedding row of tokens[start + r]. Grid (t).
extern "C" __global__ void __launch_bounds__(ROW_THREADS) embed_rows(const int* tokens, int start, Q4 table,
                                                                    float* hidden) {
    wait_previous();
    const int token = tokens[start + blockIdx.x];
    float* out = hidden + (size_t)blockIdx.x * HIDDEN;
    for (int c = threadIdx.x; c < HIDDEN; c += ROW_THREADS) {
        const u32 word = table.packed[(size_t)token * (HIDDEN / 8) + c / 8];
        const float2 f = pair_to_float2(table.scale_bias[(size_t)token * (HIDDEN / GROUP) + c / GROUP]);
        out[c] = f.x * nibble_to_float(word, 4 * (c % 8)) + f.y;
    }
}

// out[r] = bf16(rmsnorm(hidden[r]) * norm), and where `out_lo` is not null what that rounding lost, also in bf16
// (the router's products take both: routing is decided by small differences between logits). Where `expert_out`
// is not null, the previous MoE block's expert rows are first added to hidden[r] and written back, exactly as
// moe_combine adds them: the residual stream's update and the next norm in one launch. Where `parts` is not 0, the
// product before (whose output is hidden, HIDDEN columns, t rows) left its parts of k in the split slots at
// `partials` (common.cuh): they are first added to hidden[r], in order, and written back, exactly as gemm_split_sum
// with `accumulate` would add them (a launch less). Where `codes.codes` is not null, row r of out (+ out_lo) is also
// coded as Q8x2 into `codes`, as gemm_quantize_rows or moe_quantize_rows would code it: the input of the integer
// small tiling without a launch of its own. Grid (t).
// NORM_MIN_BLOCKS asks the compiler for registers enough that this many blocks fit an SM (1: its own choice).
#ifndef NORM_MIN_BLOCKS
#define NORM_MIN_BLOCKS 1
#endif
extern "C" __global__ void __launch_bounds__(ROW_THREADS, NORM_MIN_BLOCKS)
    rmsnorm_rows(float* hidden, const bf16* expert_out, const float* partials, int parts, const float* norm, bf16* out,
                 bf16* out_lo, Q8x2 codes) {
    wait_previous();
    __shared__ float scratch[32];
    // The row's rounded values, hi + lo, for the coding: a thread then takes 8 consecutive inputs (a Q8x2 word).
    __shared__ __align__(16) float rounded[HIDDEN];
    const size_t r = blockIdx.x;
    float* h = hidden + r * HIDDEN;
    // Thread u takes the row's runs of 4 consecutive columns 4 (u + ROW_THREADS j), so a warp's float4 loads cover
    // 512 contiguous bytes, and all of a thread's loads (its runs of the row and of every expert slot) are issued
    // before the first is used: none waits behind a branch or a store.
    constexpr int RUNS = (HIDDEN / 4 + ROW_THREADS - 1) / ROW_THREADS;
    static_assert(HIDDEN % 4 == 0, "whole runs of 4 columns");
    float4 v[RUNS];
    bool in[RUNS];
#pragma unroll
    for (int j = 0; j < RUNS; j++) {
        const int c0 = 4 * (threadIdx.x + j * ROW_THREADS);
        in[j] = c0 < HIDDEN;
        v[j] = in[j] ? *(const float4*)(h + c0) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    if (parts) {
#pragma unroll
        for (int j = 0; j < RUNS; j++) {
            if (!in[j]) continue;
            const int c0 = 4 * (threadIdx.x + j * ROW_THREADS);
            const float4 sum = split_parts_sum(partials, (int)r, c0, (int)gridDim.x, HIDDEN, parts);
            v[j].x += sum.x, v[j].y += sum.y, v[j].z += sum.z, v[j].w += sum.w;
            *(float4*)(h + c0) = v[j];
        }
    }
    if (expert_out) {
        // The runs stay packed (two registers a run) until they are summed, so all of them are in flight at once
        // without the registers that would keep more blocks off the SM.
        uint2 e[RUNS][MOE_SLOTS];
#pragma unroll
        for (int j = 0; j < RUNS; j++) {
            const int c0 = 4 * (threadIdx.x + j * ROW_THREADS);
#pragma unroll
            for (int k = 0; k < MOE_SLOTS; k++)
                e[j][k] = in[j] ? *(const uint2*)(expert_out + (r * MOE_SLOTS + k) * HIDDEN + c0) : make_uint2(0u, 0u);
        }
#pragma unroll
        for (int j = 0; j < RUNS; j++) {
            float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);  // in slot order, as combined_experts
#pragma unroll
            for (int k = 0; k < MOE_SLOTS; k++) {
                const float4 x = bf16x4_to_float4(e[j][k]);
                sum.x += x.x, sum.y += x.y, sum.z += x.z, sum.w += x.w;
            }
            v[j].x += sum.x, v[j].y += sum.y, v[j].z += sum.z, v[j].w += sum.w;
            if (in[j]) *(float4*)(h + 4 * (threadIdx.x + j * ROW_THREADS)) = v[j];
        }
    }
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < RUNS; j++) s += v[j].x * v[j].x + v[j].y * v[j].y + v[j].z * v[j].z + v[j].w * v[j].w;
    const float inv = 1.f / sqrtf(block_sum(s, scratch) / HIDDEN + RMS_EPS);
#pragma unroll
    for (int j = 0; j < RUNS; j++) {
        if (!in[j]) continue;
        const int c0 = 4 * (threadIdx.x + j * ROW_THREADS);
        const float4 g = *(const float4*)(norm + c0);
        const float x[4] = {v[j].x * inv * g.x, v[j].y * inv * g.y, v[j].z * inv * g.z, v[j].w * inv * g.w};
        u32 hi2[2], lo2[2];
        float rd[4];  // the sum the separate coding kernels form from the stored rows (lo is 0 where not stored)
#pragma unroll
        for (int q = 0; q < 4; q += 2) {
            const bf16 h0 = float_to_bf16(x[q]), h1 = float_to_bf16(x[q + 1]);
            const bf16 l0 = float_to_bf16(x[q] - bf16_to_float(h0)), l1 = float_to_bf16(x[q + 1] - bf16_to_float(h1));
            hi2[q / 2] = (u32)h0 | (u32)h1 << 16, lo2[q / 2] = (u32)l0 | (u32)l1 << 16;
            rd[q] = bf16_to_float(h0) + (out_lo ? bf16_to_float(l0) : 0.f);
            rd[q + 1] = bf16_to_float(h1) + (out_lo ? bf16_to_float(l1) : 0.f);
        }
        *(uint2*)(out + r * HIDDEN + c0) = make_uint2(hi2[0], hi2[1]);
        if (out_lo) *(uint2*)(out_lo + r * HIDDEN + c0) = make_uint2(lo2[0], lo2[1]);
        *(float4*)&rounded[c0] = make_float4(rd[0], rd[1], rd[2], rd[3]);
    }
    if (!codes.codes) return;  // uniform over the block
    __syncthreads();
    constexpr int WORDS = HIDDEN / 8;
    static_assert(HIDDEN % GROUP == 0, "whole groups of inputs");
#pragma unroll
    for (int w0 = 0; w0 < WORDS; w0 += ROW_THREADS) {
        const int w = w0 + threadIdx.x;
        const bool valid = w < WORDS;  // every lane takes part in the group's shuffles
        float x[8];
        const float4 a = valid ? *(const float4*)&rounded[8 * w] : make_float4(0.f, 0.f, 0.f, 0.f);
        const float4 b = valid ? *(const float4*)&rounded[8 * w + 4] : make_float4(0.f, 0.f, 0.f, 0.f);
        x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
        quantize_word_q8x2(x, w % 8, valid, (uint4*)codes.codes + r * WORDS + w,
                           (float2*)codes.pairs + r * (HIDDEN / GROUP) + w / 8);
    }
}

// ---- The router's logits (a batched decode step's rows, a prompt's chunk), on the tensor cores ----
// logits[t][e] = router[e] . x[t] for the NUM_EXPERTS + 1 router rows (the routed experts', then the shared
// expert's gate), x[t] = x_hi[t] + x_lo[t] (the normed input and what its rounding to bf16 lost: about 17
// significant bits). Routing follows small differences between logits, so no input is rounded further: the 8-bit
// codes q are exact in bf16 (8 significant bits), mma.sync m16n8k16 sums q * x_hi and q * x_lo into one f32
// fragment per group of 64 inputs, a second pair of products with an A of ones sums the group's x, and each group
// then adds scale * sum(q x) + bias * sum(x) to the f32 result (w = scale * q + bias).
//
// A block takes a strip of RT_ROWS router rows and a tile of RT_TOKENS tokens over all of k; its RT_WARPS warps
// each sum RT_GROUPS consecutive groups (the weight rows the A fragment, the tokens two n8 B fragments), fetching
// the next group's operands into registers while the tensor cores take the current one, and the warps' results are
// added in order of warp. Each sum has one fixed order whatever the number of tokens or the token's place in its
// tile, so a token's logits do not depend on the batch around it. Lane (g, t) loads 16 consecutive inputs of a
// group, 16 t .. 16 t + 15, and feeds them to its step s as the fragment's k pairs (2 t, 2 t + 1) = inputs
// 16 t + 4 s + 0, 1 and (2 t + 8, 2 t + 9) = inputs 16 t + 4 s + 2, 3: the same permutation of k on both operands,
// so one 16-byte load brings a row's codes of the whole group and two its inputs.
#define RT_ROWS 16
#define RT_TOKENS 16
#define RT_OUT (NUM_EXPERTS + 1)
#define RT_WARPS (HIDDEN / GROUP < 8 ? HIDDEN / GROUP : 8)
#define RT_THREADS (RT_WARPS * WARP)
constexpr int RT_GROUPS = HIDDEN / GROUP / RT_WARPS;
static_assert(HIDDEN % (GROUP * RT_WARPS) == 0, "every warp sums whole groups of 64 inputs");
static_assert(RT_ROWS == 16 && RT_TOKENS == 16, "one m16 fragment of rows, two n8 fragments of tokens");

// Blocks an SM holds at once. Two (128 registers a thread, a few spilled) keep more groups' fetches in flight for a
// prompt's thousands of tiles; one (194 registers, no spills) is only a little faster at a step's few.
#ifndef RT_MIN_BLOCKS
#define RT_MIN_BLOCKS 2
#endif
// router_rows_tall, for many tokens: a block takes RT_TALL_STRIPS strips of its tile, so that each token's inputs
// come from L2 once per RT_TALL_STRIPS strips instead of once per strip (the plain kernel's 17 strips each fetch
// the tile's 128 KiB of inputs, which binds it to L2's speed at long prompts). At 1 block an SM (250 registers) it
// is faster from 256 tokens on; counts of RT_TALL_MIN_TOKENS or more take it (0: never).
#ifndef RT_TALL_STRIPS
#define RT_TALL_STRIPS 3
#endif
#ifndef RT_TALL_MIN_TOKENS
#define RT_TALL_MIN_TOKENS 256
#endif

// Read by the host (the constants of src/kernels/prefill.rs).
__device__ int router_strip_rows = RT_ROWS;
__device__ int router_tile_tokens = RT_TOKENS;
__device__ int router_threads = RT_THREADS;
__device__ int router_tall_strips = RT_TALL_STRIPS;
__device__ int router_tall_min_tokens = RT_TALL_MIN_TOKENS;

// Codes 2 h and 2 h + 1 of `word` (four 8-bit codes) as bf16x2, exactly: each byte under the exponent of 2^23,
// minus 2^23, then rounded to bf16 (which holds every integer below 256).
__device__ __forceinline__ u32 codes_bf16x2(u32 word, int h) {
    const float a = __uint_as_float(__byte_perm(word, 0x4B000000u, 0x7650 + 2 * h)) - 8388608.f;
    const float b = __uint_as_float(__byte_perm(word, 0x4B000000u, 0x7651 + 2 * h)) - 8388608.f;
    return pack_bf16x2(a, b);
}

// One group's operands of lane (g, t) for STRIPS strips: each strip's rows g and g + 8's 16 codes and (scale,
// bias) pairs, and for tokens g and 8 + g of the tile 16 inputs of x_hi and of x_lo (two 16-byte halves each).
template <int STRIPS>
struct RouterGroup {
    uint4 codes[STRIPS][2];
    u32 pairs[STRIPS][2];
    uint4 hi[2][2], lo[2][2];
};

// Step s's B fragment (two words) of token fragment f from a group's 16 inputs a lane holds (hi or lo).
__device__ __forceinline__ void router_b_words(const uint4 (&x)[2][2], int f, int s, u32& w0, u32& w1) {
    w0 = word_of(x[f][s / 2], 2 * (s % 2)), w1 = word_of(x[f][s / 2], 2 * (s % 2) + 1);
}

// [token fragment]: the sums over a group's four steps of A times the lane's inputs (hi + lo), by MMAs in f32,
// `a_of(s, a)` giving step s's A fragment.
template <typename AOf>
__device__ __forceinline__ void router_products(const AOf& a_of, const uint4 (&hi)[2][2], const uint4 (&lo)[2][2],
                                                float (&d)[2][4]) {
#pragma unroll
    for (int f = 0; f < 2; f++)
#pragma unroll
        for (int j = 0; j < 4; j++) d[f][j] = 0.f;
#pragma unroll
    for (int s = 0; s < 4; s++) {
        u32 a[4];
        a_of(s, a);
#pragma unroll
        for (int f = 0; f < 2; f++) {
            u32 h0, h1, l0, l1;
            router_b_words(hi, f, s, h0, h1), router_b_words(lo, f, s, l0, l1);
            mma_bf16(d[f], a, h0, h1);
            mma_bf16(d[f], a, l0, l1);
        }
    }
}

// An A of ones: the products are the sums of x over the group, the same for every strip.
struct RouterOnes {
    __device__ __forceinline__ void operator()(int, u32 (&a)[4]) const {
        a[0] = a[1] = a[2] = a[3] = 0x3F803F80u;  // bf16 1.0 pairs
    }
};

// The A fragment of step s for rows g and g + 8 of a strip, from the 16 codes of each that a lane holds (inputs
// 16 t .. 16 t + 15, in the order the B fragments take them).
struct RouterCodes {
    const uint4 (&codes)[2];
    __device__ __forceinline__ void operator()(int s, u32 (&a)[4]) const {
        a[0] = codes_bf16x2(word_of(codes[0], s), 0), a[1] = codes_bf16x2(word_of(codes[1], s), 0);
        a[2] = codes_bf16x2(word_of(codes[0], s), 1), a[3] = codes_bf16x2(word_of(codes[1], s), 1);
    }
};

// One strip's group: acc += scale * sum(q x) + bias * sum(x) for rows g and g + 8 (their (scale, bias) `pairs`)
// and the lane's two token fragments, sum(q x) by MMAs over the four steps, `a_of(s, a)` giving step s's A
// fragment. Fragment entry j: row g + 8 (j / 2), token 2 t + j % 2 of the fragment.
template <typename AOf>
__device__ __forceinline__ void router_strip_group(const AOf& a_of, const u32 (&pairs)[2], const uint4 (&hi)[2][2],
                                                   const uint4 (&lo)[2][2], const float (&sx)[2][4],
                                                   float (&acc)[2][4]) {
    float qx[2][4];  // [token fragment]: sum(q x) over the group
    router_products(a_of, hi, lo, qx);
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const float2 sb = pair_to_float2(pairs[h]);
#pragma unroll
        for (int f = 0; f < 2; f++)
#pragma unroll
            for (int j = 2 * h; j < 2 * h + 2; j++) acc[f][j] = fmaf(sb.x, qx[f][j], fmaf(sb.y, sx[f][j], acc[f][j]));
    }
}

// The body of router_rows (STRIPS 1) and router_rows_tall: a block takes STRIPS consecutive strips of RT_ROWS
// router rows (rows past the last read the last row; their sums are never stored). Every logit is summed the
// same way in both, so the two give the same bits.
template <int STRIPS>
__device__ __forceinline__ void router_strips(const bf16* x_hi, const bf16* x_lo, int m, Q4 router, float* logits) {
    if (blockDim.x != RT_THREADS) __trap();  // the host's plan is not the kernel's
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, g = lane / 4, t = lane % 4;
    const int row0 = blockIdx.x * RT_ROWS * STRIPS, tok0 = blockIdx.y * RT_TOKENS;
    const int tokens = min(RT_TOKENS, m - tok0);
    // Tokens past the tile read the last valid one (their sums are never stored).
    size_t code0[STRIPS][2], pair0[STRIPS][2], x0[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
#pragma unroll
        for (int s = 0; s < STRIPS; s++) {
            const size_t row = min(row0 + s * RT_ROWS + g + 8 * h, RT_OUT - 1);
            code0[s][h] = row * (HIDDEN / 4) + 4 * t, pair0[s][h] = row * (HIDDEN / GROUP);
        }
        const size_t token = tok0 + min(g + 8 * h, tokens - 1);
        x0[h] = token * HIDDEN + 16 * t;
    }
    const int group0 = warp * RT_GROUPS;
    auto load_weights = [&](RouterGroup<STRIPS>& q, int group) {
#pragma unroll
        for (int s = 0; s < STRIPS; s++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                q.codes[s][h] = __ldg((const uint4*)(router.packed + code0[s][h] + group * (GROUP / 4)));
                q.pairs[s][h] = __ldg(router.scale_bias + pair0[s][h] + group);
            }
    };
    auto load_inputs = [&](RouterGroup<STRIPS>& q, int group) {
#pragma unroll
        for (int f = 0; f < 2; f++)
#pragma unroll
            for (int u = 0; u < 2; u++) {
                q.hi[f][u] = *(const uint4*)(x_hi + x0[f] + group * GROUP + 8 * u);
                q.lo[f][u] = *(const uint4*)(x_lo + x0[f] + group * GROUP + 8 * u);
            }
    };

    // The first group's weights do not depend on the previous kernel: they are requested before waiting for it.
    RouterGroup<STRIPS> cur, next;
    load_weights(cur, group0);
    wait_previous();
    load_inputs(cur, group0);
    float acc[STRIPS][2][4];
#pragma unroll
    for (int s = 0; s < STRIPS; s++)
#pragma unroll
        for (int f = 0; f < 2; f++)
#pragma unroll
            for (int i = 0; i < 4; i++) acc[s][f][i] = 0.f;
#pragma unroll
    for (int i = 0; i < RT_GROUPS; i++) {
        if (i + 1 < RT_GROUPS) {
            load_weights(next, group0 + i + 1);
            load_inputs(next, group0 + i + 1);
        }
        float sx[2][4];  // [token fragment]: sum(x) over the group, the same for every strip
        router_products(RouterOnes{}, cur.hi, cur.lo, sx);
#pragma unroll
        for (int strip = 0; strip < STRIPS; strip++) {
            router_strip_group(RouterCodes{cur.codes[strip]}, cur.pairs[strip], cur.hi, cur.lo, sx, acc[strip]);
        }
        if (i + 1 < RT_GROUPS) cur = next;
    }

    // The warps' sums, [warp][token][row of the block's strips], added in order of warp.
    constexpr int ROWS = RT_ROWS * STRIPS;
    __shared__ float part[RT_WARPS][RT_TOKENS * ROWS];
#pragma unroll
    for (int s = 0; s < STRIPS; s++)
#pragma unroll
        for (int f = 0; f < 2; f++)
#pragma unroll
            for (int j = 0; j < 4; j++)
                part[warp][(8 * f + 2 * t + j % 2) * ROWS + s * RT_ROWS + g + 8 * (j / 2)] = acc[s][f][j];
    __syncthreads();
    for (int o = threadIdx.x; o < RT_TOKENS * ROWS; o += RT_THREADS) {
        const int token = o / ROWS, r = o % ROWS;
        float v = 0.f;
#pragma unroll
        for (int w = 0; w < RT_WARPS; w++) v += part[w][o];
        if (row0 + r < RT_OUT && token < tokens) logits[(size_t)(tok0 + token) * RT_OUT + row0 + r] = v;
    }
}

extern "C" __global__ void __launch_bounds__(RT_THREADS, RT_MIN_BLOCKS)
    router_rows(const bf16* x_hi, const bf16* x_lo, int m, Q4 router, float* logits) {
    router_strips<1>(x_hi, x_lo, m, router, logits);
}

extern "C" __global__ void __launch_bounds__(RT_THREADS, 1)
    router_rows_tall(const bf16* x_hi, const bf16* x_lo, int m, Q4 router, float* logits) {
    router_strips<RT_TALL_STRIPS>(x_hi, x_lo, m, router, logits);
}

// router_rows_wide, for a prompt's chunk of thousands of tokens: router_rows_tall still fetches each tile's inputs
// once per three strips and each strip's weights once per 16 tokens, about 340 MB from L2 a layer at 4,096 tokens.
// Here a block takes RW_TOKENS tokens (RW_TOKEN_WARPS pairs of token fragments) by RW_STRIPS strips and stages each
// group of 64 inputs in shared memory (cp.async, RW_STAGES deep): the codes of its rows, the inputs of its tokens.
// In the pass over group i, beside its MMAs, the block turns group i + 1's codes into bf16 once, into one of two
// buffers. Warp (r, p) takes token pair p and strips r, r + RW_ROW_WARPS, ..., so each converted code feeds
// RW_TOKEN_WARPS warps and each staged input RW_ROW_WARPS warps. A warp walks every group of k itself and keeps one
// partial sum per run of RT_GROUPS groups, added to its total in order of run: the same products, fragment positions
// and additions as router_rows, whose warp w sums run w, so the two give the same bits.
#ifndef RW_ROW_WARPS
#define RW_ROW_WARPS 3
#endif
#ifndef RW_TOKEN_WARPS
#define RW_TOKEN_WARPS 4
#endif
#ifndef RW_STRIPS
#define RW_STRIPS 9
#endif
#ifndef RW_STAGES
#define RW_STAGES 4
#endif
// Counts of RW_MIN_TOKENS tokens or more take router_rows_wide (0: never). A block's time hardly depends on how
// many blocks run, so the kernel pays once most SMs have a block: on an H100 it was slower than router_rows_tall at
// 2,048 tokens (64 blocks) and faster from 3,072 (96 blocks); bench/RESULTS.md has the figures.
#ifndef RW_MIN_TOKENS
#define RW_MIN_TOKENS 3072
#endif
#define RW_THREADS (WARP * RW_ROW_WARPS * RW_TOKEN_WARPS)
#define RW_TOKENS (2 * 8 * RW_TOKEN_WARPS)
#define RW_ROWS (RT_ROWS * RW_STRIPS)
static_assert(RW_STRIPS % RW_ROW_WARPS == 0, "every row warp takes as many strips");
static_assert(RW_STAGES >= 3, "group i + 1 has landed while group i is multiplied");
static_assert(RW_STRIPS * WARP <= RW_THREADS, "a thread converts at most one strip's lane of codes");
constexpr int RW_GROUPS = HIDDEN / GROUP;
// A stage: the block's rows' codes of one group (64 bytes a row), then its tokens' inputs (x_hi's 128 bytes, then
// x_lo's, a token). A token's 16-byte chunk c lies at chunk c ^ (token & 1), so that the eight lanes of a
// quarter-warp (two tokens, four chunks each) read eight different banks.
constexpr int RW_CODE_BYTES = RW_ROWS * GROUP;
constexpr int RW_STAGE_BYTES = RW_CODE_BYTES + RW_TOKENS * 4 * GROUP;
// After the stages: the (scale, bias) pairs of the block's rows, [group][row].
constexpr int RW_PAIRS_AT = RW_STAGES * RW_STAGE_BYTES;
// After the pairs: two buffers of a group's codes in bf16, [strip][step][lane] of 16 bytes: lane (g, t)'s A
// fragment of that step for the strip, so that a warp reads a step's fragments in one conflict-free load.
constexpr int RW_BF16_AT = RW_PAIRS_AT + RW_GROUPS * RW_ROWS * 4;
constexpr int RW_BF16_BYTES = RW_ROWS * GROUP * 2;
// The results before their coalesced store, [token][row], in the stages' space; a token's row of RW_ROWS + 4
// floats puts the lanes of a fragment (rows g, tokens 2 t) on 32 different banks.
constexpr int RW_OUT_STRIDE = RW_ROWS + 4;
static_assert(RW_TOKENS * RW_OUT_STRIDE * 4 <= RW_PAIRS_AT, "the results fit in the stages");
constexpr int RW_SMEM = RW_BF16_AT + 2 * RW_BF16_BYTES;
// The 16-byte copies of a stage that a thread makes: codes, then inputs.
constexpr int RW_CODE_COPIES = (RW_ROWS * 4 + RW_THREADS - 1) / RW_THREADS;
constexpr int RW_INPUT_COPIES = (RW_TOKENS * 16 + RW_THREADS - 1) / RW_THREADS;

__device__ int router_wide_min_tokens = RW_MIN_TOKENS;
__device__ int router_wide_strips = RW_STRIPS;
__device__ int router_wide_tokens = RW_TOKENS;
__device__ int router_wide_threads = RW_THREADS;
__device__ int router_wide_smem = RW_SMEM;

// The A fragments of a strip's four steps, converted to bf16 beforehand: the values are RouterCodes'.
struct RouterStepCodes {
    const uint4 (&w)[4];
    __device__ __forceinline__ void operator()(int s, u32 (&a)[4]) const {
        a[0] = w[s].x, a[1] = w[s].y, a[2] = w[s].z, a[3] = w[s].w;
    }
};

extern "C" __global__ void __launch_bounds__(RW_THREADS, 1)
    router_rows_wide(const bf16* x_hi, const bf16* x_lo, int m, Q4 router, float* logits) {
    if (blockDim.x != RW_THREADS) __trap();  // the host's plan is not the kernel's
    extern __shared__ __align__(128) unsigned char smem[];
    const u32 base = (u32)__cvta_generic_to_shared(smem);
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, g = lane / 4, t = lane % 4;
    const int row_warp = warp % RW_ROW_WARPS, pair = warp / RW_ROW_WARPS;
    const int row0 = blockIdx.x * RW_ROWS, tok0 = blockIdx.y * RW_TOKENS;
    const int tokens = min(RW_TOKENS, m - tok0);

    // The block's pairs do not depend on the previous kernel: they are read before waiting for it. Rows past the
    // last read the last row (their sums are never stored).
    u32* pairs = (u32*)(smem + RW_PAIRS_AT);
    for (int i = threadIdx.x; i < RW_GROUPS * RW_ROWS; i += RW_THREADS) {
        const int group = i / RW_ROWS, r = i % RW_ROWS;
        pairs[i] = __ldg(router.scale_bias + (size_t)min(row0 + r, RT_OUT - 1) * RW_GROUPS + group);
    }
    // Each copy's source at group 0 and its place in a stage, worked out once: a group's copies only move the
    // source on by GROUP inputs. Copies past a stage's count are not made; tokens past the count read zeros (their
    // sums are never stored).
    const u32* code_src[RW_CODE_COPIES];
    u32 code_dst[RW_CODE_COPIES];
#pragma unroll
    for (int k = 0; k < RW_CODE_COPIES; k++) {
        const int c = threadIdx.x + k * RW_THREADS;
        const size_t row = min(row0 + c / 4, RT_OUT - 1);
        code_src[k] = router.packed + row * (HIDDEN / 4) + 4 * (c % 4);
        code_dst[k] = c < RW_ROWS * 4 ? 16 * c : ~0u;
    }
    const bf16* input_src[RW_INPUT_COPIES];
    u32 input_dst[RW_INPUT_COPIES];
#pragma unroll
    for (int k = 0; k < RW_INPUT_COPIES; k++) {
        const int c = threadIdx.x + k * RW_THREADS, n = c / 16, chunk = c % 16;
        input_src[k] = (chunk < 8 ? x_hi : x_lo) + (size_t)(tok0 + min(n, tokens - 1)) * HIDDEN + 8 * (chunk % 8);
        input_dst[k] = c >= RW_TOKENS * 16 ? ~0u : RW_CODE_BYTES + n * 4 * GROUP + 16 * (chunk ^ (n & 1));
        if (c < RW_TOKENS * 16 && n >= tokens) input_dst[k] |= 1u << 31;  // a token past the count: zeros
    }
    auto load_codes = [&](int stage, int group) {
#pragma unroll
        for (int k = 0; k < RW_CODE_COPIES; k++)
            if (code_dst[k] != ~0u)
                cp_async_16(base + stage * RW_STAGE_BYTES + code_dst[k], code_src[k] + group * (GROUP / 4), 16);
    };
    auto load_inputs = [&](int stage, int group) {
#pragma unroll
        for (int k = 0; k < RW_INPUT_COPIES; k++)
            if (input_dst[k] != ~0u)
                cp_async_16(base + stage * RW_STAGE_BYTES + (input_dst[k] & ~(1u << 31)), input_src[k] + group * GROUP,
                            input_dst[k] >> 31 ? 0 : 16);
    };
    // Group `group`'s codes, landed at `stage`, into bf16 buffer group % 2 (when `on`): item (strip, lane (g, t))
    // turns the 16 codes of rows g and g + 8 that RouterCodes would take into the lane's four A fragments. Thread q
    // takes item q. The work has no branch, only predicated stores, so that the compiler can interleave it with the
    // MMAs of the group before.
    auto codes_to_bf16 = [&](int stage, int group, bool on) {
        uint4* to = (uint4*)(smem + RW_BF16_AT + (group % 2) * RW_BF16_BYTES);
        const int q = min((int)threadIdx.x, RW_STRIPS * WARP - 1);
        const int strip = q / WARP, l = q % WARP, r = RT_ROWS * strip + l / 4;
        uint4 codes[2];
#pragma unroll
        for (int h = 0; h < 2; h++)
            codes[h] = *(const uint4*)(smem + stage * RW_STAGE_BYTES + (r + 8 * h) * GROUP + 16 * (l % 4));
        on = on && threadIdx.x < RW_STRIPS * WARP;
#pragma unroll
        for (int s = 0; s < 4; s++) {
            u32 a[4];
            RouterCodes{codes}(s, a);
            if (on) to[(4 * strip + s) * WARP + l] = make_uint4(a[0], a[1], a[2], a[3]);
        }
    };
#pragma unroll
    for (int s = 0; s < RW_STAGES - 1; s++)
        if (s < RW_GROUPS) load_codes(s, s);
    wait_previous();
#pragma unroll
    for (int s = 0; s < RW_STAGES - 1; s++) {
        if (s < RW_GROUPS) load_inputs(s, s);
        cp_async_commit();
    }
    cp_async_wait<RW_STAGES - 2>();
    __syncthreads();
    codes_to_bf16(0, 0, true);

    constexpr int MINE = RW_STRIPS / RW_ROW_WARPS;
    float part[MINE][2][4], total[MINE][2][4];
#pragma unroll
    for (int s = 0; s < MINE; s++)
#pragma unroll
        for (int f = 0; f < 2; f++)
#pragma unroll
            for (int j = 0; j < 4; j++) part[s][f][j] = 0.f, total[s][f][j] = 0.f;
    for (int i = 0; i < RW_GROUPS; i++) {
        // Groups up to i + 1 have landed, and every warp is done with group i - 1's stage and bf16 buffer.
        cp_async_wait<RW_STAGES - 3>();
        __syncthreads();
        if (i + RW_STAGES - 1 < RW_GROUPS) {
            const int next = i + RW_STAGES - 1;
            load_codes(next % RW_STAGES, next);
            load_inputs(next % RW_STAGES, next);
        }
        cp_async_commit();
        const unsigned char* stage = smem + (i % RW_STAGES) * RW_STAGE_BYTES;
        const uint4* wq = (const uint4*)(smem + RW_BF16_AT + (i % 2) * RW_BF16_BYTES);
        // Lane (g, t)'s 16 inputs 16 t .. 16 t + 15 of tokens g and 8 + g of its pair, as router_rows loads them.
        uint4 hi[2][2], lo[2][2];
#pragma unroll
        for (int f = 0; f < 2; f++) {
            const int n = 16 * pair + 8 * f + g;
            const unsigned char* x = stage + RW_CODE_BYTES + n * 4 * GROUP;
#pragma unroll
            for (int u = 0; u < 2; u++) {
                hi[f][u] = *(const uint4*)(x + 16 * ((2 * t + u) ^ (n & 1)));
                lo[f][u] = *(const uint4*)(x + 16 * ((8 + 2 * t + u) ^ (n & 1)));
            }
        }
        float sx[2][4];
        router_products(RouterOnes{}, hi, lo, sx);
#pragma unroll
        for (int k = 0; k < MINE; k++) {
            // A strip wholly past the last row is summed too (its codes are the last row's, its sums never
            // stored): with no branch between them, the strips' chains of MMAs overlap.
            const int strip = row_warp + RW_ROW_WARPS * k;
            u32 pair_of[2];
#pragma unroll
            for (int h = 0; h < 2; h++) pair_of[h] = pairs[i * RW_ROWS + RT_ROWS * strip + g + 8 * h];
            uint4 w[4];
#pragma unroll
            for (int s = 0; s < 4; s++) w[s] = wq[(4 * strip + s) * WARP + lane];
            router_strip_group(RouterStepCodes{w}, pair_of, hi, lo, sx, part[k]);
        }
        // Group i + 1's codes in bf16, after group i's fragments have been read (its stores may not pass them).
        codes_to_bf16((i + 1) % RW_STAGES, i + 1, i + 1 < RW_GROUPS);
        // The end of a run of RT_GROUPS groups (router_rows' warp): its sum joins the total, in order of run.
        if ((i + 1) % RT_GROUPS == 0) {
#pragma unroll
            for (int k = 0; k < MINE; k++)
#pragma unroll
                for (int f = 0; f < 2; f++)
#pragma unroll
                    for (int j = 0; j < 4; j++) total[k][f][j] += part[k][f][j], part[k][f][j] = 0.f;
        }
    }

    // The totals through shared memory ([token][row]), then out in rows of consecutive logits.
    cp_async_wait<0>();
    __syncthreads();
    float* out = (float*)smem;
#pragma unroll
    for (int k = 0; k < MINE; k++)
#pragma unroll
        for (int f = 0; f < 2; f++)
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int r = RT_ROWS * (row_warp + RW_ROW_WARPS * k) + g + 8 * (j / 2);
                out[(16 * pair + 8 * f + 2 * t + j % 2) * RW_OUT_STRIDE + r] = total[k][f][j];
            }
    __syncthreads();
    for (int o = threadIdx.x; o < RW_TOKENS * RW_ROWS; o += RW_THREADS) {
        const int token = o / RW_ROWS, r = o % RW_ROWS;
        if (row0 + r < RT_OUT && token < tokens)
            logits[(size_t)(tok0 + token) * RT_OUT + row0 + r] = out[token * RW_OUT_STRIDE + r];
    }
}

// Softmax over the router logits, the TOP_K largest (lowest index first on ties), renormalised; one warp. A NaN
// logit ranks and weighs as negative infinity (rank_value), and a chosen expert's value becomes NaN, which never
// ranks before another, so the TOP_K experts are distinct and in range whatever the logits (as cpu::moe::route).
__device__ void route(const float* logits, int* ids, float* weights) {
    constexpr int PER_LANE = (NUM_EXPERTS + WARP - 1) / WARP;
    const int lane = threadIdx.x % WARP;
    float v[PER_LANE];
    float mx = -INF_F;
#pragma unroll
    for (int i = 0; i < PER_LANE; i++) {
        const int e = lane + WARP * i;
        v[i] = e < NUM_EXPERTS ? rank_value(logits[e]) : -INF_F;
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
            if (lane + WARP * i == best_e) v[i] = NAN_F;  // never ranks before anything: chosen once
        const float p = expf(best - mx) / denom;
        chosen_sum += p;
        if (lane == 0) ids[slot] = best_e, weights[slot] = p;
    }
    __syncwarp();
    if (lane < TOP_K) weights[lane] /= chosen_sum;
    __syncwarp();
}

// The grouped expert products take the shared expert as expert NUM_EXPERTS: a token has MOE_SLOTS entries,
// token * MOE_SLOTS + slot.
// One warp per token: route_ids/route_w [t][MOE_SLOTS] (the shared expert and its sigmoid gate in the last slot),
// counts[e] += entries of routed expert e (zeroed before) and counts[NUM_EXPERTS] = t (the shared one), and, where
// `masks` is not null, bit token % 32 of word masks[e][token / 32] set for each routed expert e (zeroed before;
// `mask_words` words an expert), from which moe_sort lists an expert's tokens. logits: [t][NUM_EXPERTS + 1].
extern "C" __global__ void __launch_bounds__(ROW_THREADS) route_rows(const float* logits, int t, int* route_ids,
                                                                    float* route_w, int* counts, u32* masks,
                                                                    int mask_words) {
    wait_previous();
    __shared__ int ids[ROW_THREADS / WARP][TOP_K];
    __shared__ float weights[ROW_THREADS / WARP][TOP_K];
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int token = blockIdx.x * (ROW_THREADS / WARP) + warp;
    if (token >= t) return;
    const float* l = logits + (size_t)token * (NUM_EXPERTS + 1);
    route(l, ids[warp], weights[warp]);
    if (lane < TOP_K) {
        route_ids[token * MOE_SLOTS + lane] = ids[warp][lane];
        route_w[token * MOE_SLOTS + lane] = weights[warp][lane];
        atomicAdd(&counts[ids[warp][lane]], 1);
        if (masks) atomicOr(&masks[(size_t)ids[warp][lane] * mask_words + token / 32], 1u << (token % 32));
    }
    if (lane == TOP_K) {
        route_ids[token * MOE_SLOTS + TOP_K] = NUM_EXPERTS;
        route_w[token * MOE_SLOTS + TOP_K] = sigmoidf_(l[NUM_EXPERTS]);
    }
    // Every token has the shared expert: its count is t, written once rather than added to by every token.
    if (token == 0 && lane == 0) counts[NUM_EXPERTS] = t;
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

// From this many tokens the routing also leaves each routed expert's tokens as bits, and moe_sort's block for an
// expert reads its bits instead of passing over every entry. The pass costs a block ~t * MOE_SLOTS reads, the bits
// t / 32 words and an atomic an entry in route_rows: below the limit the pass is as fast or faster, and the launch
// that clears the bits is the same one that clears the counts. The host reads the limit.
#ifndef SORT_MASKS_MIN_TOKENS
#define SORT_MASKS_MIN_TOKENS 1024
#endif
extern "C" __device__ const int sort_masks_min_tokens = SORT_MASKS_MIN_TOKENS;

// Expert e's entries in ascending order from `at` on, found by a pass over all t * MOE_SLOTS entries: four
// consecutive entries a thread per pass, ranked by a warp scan of the match counts, then the warps'. moe_sort's
// fallback for an expert that some token holds in more than one slot (its bits then count it once).
__device__ void sort_by_scan(const int* route_ids, int t, int e, int at, int* entries, int* warp_totals) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, n_entries = t * MOE_SLOTS;
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
        __syncthreads();  // the previous pass has read warp_totals
        if (lane == WARP - 1) warp_totals[warp] = inclusive;
        __syncthreads();
        int mine_at = at + inclusive - mine, pass_total = 0;
#pragma unroll
        for (int w = 0; w < SORT_THREADS / WARP; w++) {
            if (w < warp) mine_at += warp_totals[w];
            pass_total += warp_totals[w];
        }
#pragma unroll
        for (int j = 0; j < 4; j++)
            if (match[j]) entries[mine_at++] = i0 + j;
        at += pass_total;
    }
}

// Block e: expert e's place in the sorted order (offsets[e], and offsets[GROUPS] = t * MOE_SLOTS), its tiles of
// `tile_rows` entries (tiles[i] = (expert, first sorted index); *tile_count = all tiles), and its entries in
// ascending order (a stable sort, so the grouped products and their sums are deterministic). Grid (GROUPS): the
// routed experts and the shared one. A routed expert's tokens come from its bits in `masks` (route_rows'), so a
// block reads mask_words words and its tokens' slots rather than every entry. Where its bits are fewer than its
// count, a token holds the expert in more than one slot (route() picks distinct experts, so only a routing written
// otherwise could), and the block finds its entries by a pass over all of them instead: every entry has its place.
// Where `masks` is null (fewer than SORT_MASKS_MIN_TOKENS tokens), every block makes that pass.
extern "C" __global__ void __launch_bounds__(SORT_THREADS) moe_sort(const int* route_ids, int t, const int* counts,
                                                                   const u32* masks, int mask_words, int tile_rows,
                                                                   int* offsets, int* entries, int* tiles,
                                                                   int* tile_count) {
    wait_previous();
    __shared__ int scratch[SORT_THREADS / WARP];
    __shared__ int warp_totals[SORT_THREADS / WARP];
    const int e = blockIdx.x, lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    constexpr int GROUPS = NUM_EXPERTS + 1;
    int before = 0, tiles_before = 0, tiles_all = 0;
    for (int i = threadIdx.x; i < GROUPS; i += SORT_THREADS) {
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
        if (e == GROUPS - 1) offsets[GROUPS] = offset + count, *tile_count = total_tiles;
    }
    for (int j = threadIdx.x; j * tile_rows < count; j += SORT_THREADS) {
        tiles[2 * (first_tile + j)] = e;
        tiles[2 * (first_tile + j) + 1] = offset + j * tile_rows;
    }
    // The shared expert is in every token's last slot: its entries are the tokens in order.
    if (e == NUM_EXPERTS) {
        for (int r = threadIdx.x; r < t; r += SORT_THREADS) entries[offset + r] = r * MOE_SLOTS + TOP_K;
        return;
    }
    if (!masks) return sort_by_scan(route_ids, t, e, offset, entries, warp_totals);  // uniform
    // Thread u takes mask words [u per, (u + 1) per): its rank is the bits before them (a warp scan, then the
    // warps'), and each set bit r is token r's entry in the slot that holds e.
    const u32* mask = masks + (size_t)e * mask_words;
    const int per = (mask_words + SORT_THREADS - 1) / SORT_THREADS, w0 = threadIdx.x * per;
    const int w1 = min(w0 + per, mask_words);
    int mine = 0;
    for (int w = w0; w < w1; w++) mine += __popc(mask[w]);
    int inclusive = mine;
#pragma unroll
    for (int o = 1; o < WARP; o <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, inclusive, o);
        if (lane >= o) inclusive += v;
    }
    if (lane == WARP - 1) warp_totals[warp] = inclusive;
    __syncthreads();
    int at = offset + inclusive - mine, bits_all = 0;
    for (int w = 0; w < SORT_THREADS / WARP; w++) {
        if (w < warp) at += warp_totals[w];
        bits_all += warp_totals[w];
    }
    if (bits_all != count) return sort_by_scan(route_ids, t, e, offset, entries, warp_totals);  // uniform
    for (int w = w0; w < w1; w++)
        for (u32 bits = mask[w]; bits; bits &= bits - 1) {
            const int r = 32 * w + __ffs(bits) - 1;
            int slot = 0;
            while (slot < TOP_K - 1 && route_ids[r * MOE_SLOTS + slot] != e) slot++;
            entries[at++] = r * MOE_SLOTS + slot;
        }
}

// ---- Short routings in one block (moe_route_sort) ----
// A routing of at most ROUTE_SORT_MAX_TOKENS tokens (a short prompt, a batched decode step) is three dependent
// launches of a few microseconds each above: the counts' clearing, route_rows and moe_sort's block per expert.
// moe_route_sort does all three in one block, with the same results. A warp routes a token at a time as route_rows
// does, counting its entries and marking the token in its experts' bit masks (token r is bit r, so at most 64
// tokens). Then one warp scans the counts and tiles into each expert's offset and first tile, and every entry goes
// straight to its place: an expert holds at most one entry a token (the routed experts are distinct, the shared
// one is apart), so an entry's rank within its expert is the number of earlier tokens in the mask, which keeps the
// order stable. route() picks distinct experts for any logits; should a token still hold an expert twice, each
// expert's entries are placed by a thread that walks all the entries in order instead, so every entry has a place.
// The limit is 16 tokens, a warp each: beyond that a warp routes several tokens one after another, and the three
// launches, whose routing spreads over blocks, are faster (32 tokens 2% and a 64-row decode step 5% slower on one
// block). ROUTE_SORT_MAX_TOKENS 0 keeps the three launches at every count.
#ifndef ROUTE_SORT_MAX_TOKENS
#define ROUTE_SORT_MAX_TOKENS 16
#endif
#define ROUTE_SORT_THREADS 512
static_assert(ROUTE_SORT_MAX_TOKENS >= 0 && ROUTE_SORT_MAX_TOKENS <= 64, "a token a bit of a 64-bit mask");
static_assert(ROUTE_SORT_THREADS >= NUM_EXPERTS + 1, "a thread an expert where the entries are walked");
extern "C" __device__ const int route_sort_max_tokens = ROUTE_SORT_MAX_TOKENS;
extern "C" __device__ const int route_sort_threads = ROUTE_SORT_THREADS;

// One block of ROUTE_SORT_THREADS threads, t <= ROUTE_SORT_MAX_TOKENS. Leaves route_ids, route_w, counts (and the
// `work_len` work counters after them zeroed), offsets, entries, tiles and tile_count as route_rows after a
// cleared count, then moe_sort, leave them.
extern "C" __global__ void __launch_bounds__(ROUTE_SORT_THREADS)
    moe_route_sort(const float* logits, int t, int tile_rows, int* route_ids, float* route_w, int* counts,
                   int work_len, int* offsets, int* entries, int* tiles, int* tile_count) {
    wait_previous();
    constexpr int GROUPS = NUM_EXPERTS + 1, WARPS = ROUTE_SORT_THREADS / WARP;
    constexpr int PER_LANE = (GROUPS + WARP - 1) / WARP;
    constexpr int MAX_ENTRIES = (ROUTE_SORT_MAX_TOKENS > 0 ? ROUTE_SORT_MAX_TOKENS : 1) * MOE_SLOTS;
    if (t > ROUTE_SORT_MAX_TOKENS || blockDim.x != ROUTE_SORT_THREADS) __trap();  // the host's launch is not ours
    __shared__ unsigned long long masks[GROUPS];
    __shared__ int count[GROUPS], first[GROUPS];
    __shared__ int ids[MAX_ENTRIES];
    __shared__ int picked[WARPS][TOP_K];
    __shared__ float weights[WARPS][TOP_K];
    __shared__ int repeated;
    const int tid = threadIdx.x, warp = tid / WARP, lane = tid % WARP;
    for (int i = tid; i < GROUPS; i += ROUTE_SORT_THREADS) masks[i] = 0, count[i] = 0;
    for (int i = tid; i < work_len; i += ROUTE_SORT_THREADS) counts[GROUPS + i] = 0;
    if (tid == 0) repeated = 0;
    __syncthreads();
    for (int token = warp; token < t; token += WARPS) {
        const float* l = logits + (size_t)token * (NUM_EXPERTS + 1);
        route(l, picked[warp], weights[warp]);
        const int entry = token * MOE_SLOTS + lane;
        if (lane <= TOP_K) {
            const int id = lane < TOP_K ? picked[warp][lane] : NUM_EXPERTS;
            route_ids[entry] = id;
            route_w[entry] = lane < TOP_K ? weights[warp][lane] : sigmoidf_(l[NUM_EXPERTS]);
            ids[entry] = id;
            atomicAdd(&count[id], 1);
            if (atomicOr(&masks[id], 1ull << token) & (1ull << token)) repeated = 1;
        }
        __syncwarp();  // the next token's route() rewrites picked and weights
    }
    __syncthreads();
    // Warp 0: lane j takes groups PER_LANE j .., their counts and tiles scanned across the warp.
    if (warp == 0) {
        int n[PER_LANE], n_tiles[PER_LANE], sum = 0, tile_sum = 0;
#pragma unroll
        for (int i = 0; i < PER_LANE; i++) {
            const int g = PER_LANE * lane + i;
            n[i] = g < GROUPS ? count[g] : 0;
            n_tiles[i] = (n[i] + tile_rows - 1) / tile_rows;
            sum += n[i];
            tile_sum += n_tiles[i];
        }
        int before = sum, tiles_before = tile_sum;
#pragma unroll
        for (int o = 1; o < WARP; o <<= 1) {
            const int a = __shfl_up_sync(0xffffffffu, before, o), b = __shfl_up_sync(0xffffffffu, tiles_before, o);
            if (lane >= o) before += a, tiles_before += b;
        }
        before -= sum;
        tiles_before -= tile_sum;
#pragma unroll
        for (int i = 0; i < PER_LANE; i++) {
            const int g = PER_LANE * lane + i;
            if (g < GROUPS) {
                counts[g] = n[i];
                offsets[g] = before;
                first[g] = before;
                for (int j = 0; j < n_tiles[i]; j++) {
                    tiles[2 * (tiles_before + j)] = g;
                    tiles[2 * (tiles_before + j) + 1] = before + j * tile_rows;
                }
            }
            before += n[i];
            tiles_before += n_tiles[i];
        }
        if (lane == WARP - 1) offsets[GROUPS] = before, *tile_count = tiles_before;
    }
    __syncthreads();
    if (!repeated) {
        for (int entry = tid; entry < t * MOE_SLOTS; entry += ROUTE_SORT_THREADS) {
            const int id = ids[entry], token = entry / MOE_SLOTS;
            entries[first[id] + __popcll(masks[id] & ((1ull << token) - 1))] = entry;
        }
    } else if (tid < GROUPS) {
        int at = first[tid];
        for (int entry = 0; entry < t * MOE_SLOTS; entry++)
            if (ids[entry] == tid) entries[at++] = entry;
    }
}

// hidden[r] += the sum over slots of expert_out[r * MOE_SLOTS + slot] (each already weighted; the shared expert's
// last), for the rows whose next kernel is not an rmsnorm_rows that adds them itself. Grid (t).
extern "C" __global__ void __launch_bounds__(ROW_THREADS) moe_combine(float* hidden, const bf16* expert_out) {
    wait_previous();
    const size_t r = blockIdx.x;
    for (int c = threadIdx.x; c < HIDDEN; c += ROW_THREADS) hidden[r * HIDDEN + c] += combined_experts(expert_out, r, c);
}
