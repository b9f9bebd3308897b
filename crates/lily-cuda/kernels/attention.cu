// Gated full attention, decode: q/k norms and partial RoPE with the cache write; flash-decoding over the context
// split in ATTN_SPLITS parts per KV head (the GQA query heads of a KV head read each key and value once); the
// merge of the parts with the output gate applied.
//
// KV: bf16 pools per layer for keys and for values, [page][KV_PAGE][kv head][HEAD_DIM]; the page table holds
// pages_per_seq page ids a slot (see kv_offset in common.cuh).
//
// Batched: blockIdx.z is the batch row b, a token of the sequence in slot slots[b] at position positions[b]. Its
// rows: proj + b * PROJ_ROW, q + b * Q_DIM, part_o + b * N_HEADS * ATTN_SPLITS * HEAD_DIM, part_ml + b * N_HEADS *
// ATTN_SPLITS * 2, the output + b * Q_DIM.

#define GQA (N_HEADS / N_KV_HEADS)
#define ATTN_THREADS 256
#define ATTN_WARPS (ATTN_THREADS / WARP)
#define ATTN_TILE 256       // positions scored at once by a block
#define ATTN_MIN_CHUNK 64   // fewest positions a part takes
static_assert(HEAD_DIM == ATTN_THREADS, "one thread per head dimension");
static_assert(GQA == 8, "the score loop holds the 8 query heads of a KV head");
#define PROJ_ROW (2 * Q_DIM + 2 * KV_DIM)
#define PART_O_ROW ((size_t)N_HEADS * ATTN_SPLITS * HEAD_DIM)
#define PART_ML_ROW ((size_t)N_HEADS * ATTN_SPLITS * 2)
// Pages a tile of ATTN_TILE positions starting anywhere touches at most.
#define TILE_PAGES (ATTN_TILE / KV_PAGE + 1)

// Positions per part for a context of `len` split in at most `splits` (<= ATTN_SPLITS) parts; the same in the
// partial and the merge kernels. A batched step with many rows uses fewer parts than one sequence alone: its rows
// already fill the GPU, and every part costs a block.
__device__ __forceinline__ int attn_chunk(int len, int splits) {
    int c = (len + splits - 1) / splits;
    c = (c + 31) / 32 * 32;
    return c < ATTN_MIN_CHUNK ? ATTN_MIN_CHUNK : c;
}

// Grid (N_HEADS + N_KV_HEADS, 1, rows). Blocks 0..N_HEADS: query heads (rmsnorm, RoPE, scaled by 1/sqrt(HEAD_DIM))
// into q_out; then KV heads: key (rmsnorm, RoPE) and value into the pools at the row's position through its slot's
// page-table row. proj: [q|gate per head (2 Q_DIM) | k | v].
extern "C" __global__ void __launch_bounds__(HEAD_DIM) attn_prep(const int* positions, const int* slots,
                                                                 const float* proj, const float* q_norm,
                                                                 const float* k_norm, const float* inv_freq,
                                                                 float* q_out, bf16* k_pool, bf16* v_pool,
                                                                 const int* page_table, int pages_per_seq) {
    __shared__ float x[HEAD_DIM];
    __shared__ float scratch[32];
    // The positions, slots and page table are not written by this step's kernels: read before the wait.
    const int row = blockIdx.z;
    const int position = positions[row];
    proj += (size_t)row * PROJ_ROW;
    q_out += (size_t)row * Q_DIM;
    const int d = threadIdx.x;
    const bool is_query = blockIdx.x < N_HEADS;
    const int kv_head = blockIdx.x - N_HEADS;
    const size_t at = is_query ? 0 : kv_offset(page_table + (size_t)slots[row] * pages_per_seq, position) +
                                         kv_head * HEAD_DIM + d;
    wait_previous();
    const float raw = is_query ? proj[blockIdx.x * 2 * HEAD_DIM + d] : proj[2 * Q_DIM + kv_head * HEAD_DIM + d];
    const float inv = 1.f / sqrtf(block_sum(raw * raw, scratch) / HEAD_DIM + RMS_EPS);
    x[d] = raw * inv * (is_query ? q_norm[d] : k_norm[d]);
    __syncthreads();
    float y = x[d];
    constexpr int HALF = ROT_DIM / 2;
    if (d < ROT_DIM) {
        const int i = d % HALF;
        float sn, cs;
        sincosf((float)position * inv_freq[i], &sn, &cs);
        y = d < HALF ? x[d] * cs - x[d + HALF] * sn : x[d] * cs + x[d - HALF] * sn;
    }
    if (is_query) {
        q_out[blockIdx.x * HEAD_DIM + d] = y * (1.f / sqrtf((float)HEAD_DIM));
    } else {
        k_pool[at] = float_to_bf16(y);
        v_pool[at] = float_to_bf16(proj[2 * Q_DIM + KV_DIM + kv_head * HEAD_DIM + d]);
    }
}

// Scores of the GQA query heads against key rows. The query sits in shared memory as [dim][head] with 16 bytes of
// padding after every 8-dimension piece (see score_quartered). Even and odd dimensions go to separate sums: half
// as long a chain of dependent FMAs.
__device__ __forceinline__ int q_at(int d) { return d * GQA + (d >> 3) * 4; }

// s[h] and s_odd[h] += the key's 8-dimension piece `raw` (dims d0 ..) against query head h.
__device__ __forceinline__ void score_piece(const float* qs, uint4 raw, int d0, float (&s)[GQA], float (&s_odd)[GQA]) {
    const u32 k2[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int e = 0; e < 4; e++) {
        const float2 kf = pair_to_float2(k2[e]);  // dims d0 + 2e (low) and d0 + 2e + 1 (high)
        const float4* qa = (const float4*)&qs[q_at(d0 + 2 * e)];
        const float4* qb = (const float4*)&qs[q_at(d0 + 2 * e + 1)];
        const float4 a0 = qa[0], a1 = qa[1], b0 = qb[0], b1 = qb[1];
        s[0] = fmaf(kf.x, a0.x, s[0]), s_odd[0] = fmaf(kf.y, b0.x, s_odd[0]);
        s[1] = fmaf(kf.x, a0.y, s[1]), s_odd[1] = fmaf(kf.y, b0.y, s_odd[1]);
        s[2] = fmaf(kf.x, a0.z, s[2]), s_odd[2] = fmaf(kf.y, b0.z, s_odd[2]);
        s[3] = fmaf(kf.x, a0.w, s[3]), s_odd[3] = fmaf(kf.y, b0.w, s_odd[3]);
        s[4] = fmaf(kf.x, a1.x, s[4]), s_odd[4] = fmaf(kf.y, b1.x, s_odd[4]);
        s[5] = fmaf(kf.x, a1.y, s[5]), s_odd[5] = fmaf(kf.y, b1.y, s_odd[5]);
        s[6] = fmaf(kf.x, a1.z, s[6]), s_odd[6] = fmaf(kf.y, b1.z, s_odd[6]);
        s[7] = fmaf(kf.x, a1.w, s[7]), s_odd[7] = fmaf(kf.y, b1.w, s_odd[7]);
    }
}

__device__ __forceinline__ void store_scores(float (&row)[GQA], const float (&s)[GQA], bool in) {
    *(float4*)&row[0] = in ? make_float4(s[0], s[1], s[2], s[3]) : make_float4(-INF_F, -INF_F, -INF_F, -INF_F);
    *(float4*)&row[4] = in ? make_float4(s[4], s[5], s[6], s[7]) : make_float4(-INF_F, -INF_F, -INF_F, -INF_F);
}

// The key row of `pos` (in the tile whose first page is page `page0` of the sequence) for kv_head.
__device__ __forceinline__ const uint4* key_row(const bf16* k_pool, const int* tile_pages, int page0, int pos,
                                                int kv_head) {
    const int page = tile_pages[pos / KV_PAGE - page0];
    return (const uint4*)(k_pool + ((size_t)page * KV_PAGE + pos % KV_PAGE) * KV_DIM + kv_head * HEAD_DIM);
}

// Short parts (up to SCORE_ROWS positions): four threads a position, each a quarter of the dimensions. Quarter qd
// reads 16-byte pieces 4c + qd of the key row, so the four read 64 contiguous bytes at once and a thread's loads
// are all in flight together; the padding puts the four quarters' query reads in different banks. Rows past the
// part get -inf.
#define SCORE_ROWS (ATTN_THREADS / 4)
__device__ __forceinline__ void score_quartered(const float* qs, const bf16* k_pool, const int* tile_pages,
                                                int kv_head, int tile, int end, float (*p)[GQA]) {
    constexpr int PIECES = HEAD_DIM / 8 / 4;
    const int qd = threadIdx.x % 4, row = threadIdx.x / 4, pos = tile + row;
    float s[GQA], s_odd[GQA];
#pragma unroll
    for (int h = 0; h < GQA; h++) s[h] = 0.f, s_odd[h] = 0.f;
    if (pos < end) {
        const uint4* krow = key_row(k_pool, tile_pages, tile / KV_PAGE, pos, kv_head);
        uint4 raw[PIECES];
#pragma unroll
        for (int c = 0; c < PIECES; c++) raw[c] = krow[4 * c + qd];
#pragma unroll
        for (int c = 0; c < PIECES; c++) score_piece(qs, raw[c], 8 * (4 * c + qd), s, s_odd);
    }
#pragma unroll
    for (int h = 0; h < GQA; h++) {
        s[h] += s_odd[h];
        s[h] += __shfl_xor_sync(0xffffffffu, s[h], 1);
        s[h] += __shfl_xor_sync(0xffffffffu, s[h], 2);
    }
    if (qd == 0) store_scores(p[row], s, pos < end);
    for (int r = SCORE_ROWS + threadIdx.x; r < ATTN_TILE; r += ATTN_THREADS) store_scores(p[r], s, false);
}

// Longer parts: a thread a position, a whole tile at once.
__device__ __forceinline__ void score_whole(const float* qs, const bf16* k_pool, const int* tile_pages, int kv_head,
                                            int tile, int end, float (*p)[GQA]) {
    const int pos = tile + threadIdx.x;
    float s[GQA], s_odd[GQA];
#pragma unroll
    for (int h = 0; h < GQA; h++) s[h] = 0.f, s_odd[h] = 0.f;
    if (pos < end) {
        const uint4* krow = key_row(k_pool, tile_pages, tile / KV_PAGE, pos, kv_head);
#pragma unroll 8
        for (int c = 0; c < HEAD_DIM / 8; c++) score_piece(qs, krow[c], 8 * c, s, s_odd);
    }
#pragma unroll
    for (int h = 0; h < GQA; h++) s[h] += s_odd[h];
    store_scores(p[threadIdx.x], s, pos < end);
}

// Grid (N_KV_HEADS, splits, rows). Part `split` of the row's context [0, position] for the GQA query heads of
// a KV head: writes the unnormalised output, the running max and the sum of exponentials per query head. Each tile
// of positions first takes the ids of the pages it touches into shared memory.
extern "C" __global__ void __launch_bounds__(ATTN_THREADS)
    attn_partial(const int* positions, const int* slots, const float* q, const bf16* k_pool, const bf16* v_pool,
                 const int* page_table, int pages_per_seq, int splits, float* part_o, float* part_ml) {
    __shared__ __align__(16) float qs[HEAD_DIM * GQA + HEAD_DIM / 2];  // see q_at
    __shared__ __align__(16) float p[ATTN_TILE][GQA];
    __shared__ float run_max[GQA], run_sum[GQA], rescale[GQA];
    __shared__ __align__(16) float red[ATTN_WARPS][HEAD_DIM];
    __shared__ int tile_pages[TILE_PAGES];
    // The positions, slots and page table are not written by this step's kernels: the first tile's page ids are
    // requested before the wait.
    const int row = blockIdx.z;
    const int len = positions[row] + 1;
    const int* pages = page_table + (size_t)slots[row] * pages_per_seq;
    q += (size_t)row * Q_DIM;
    part_o += row * PART_O_ROW;
    part_ml += row * PART_ML_ROW;
    const int chunk = attn_chunk(len, splits);
    const int kv_head = blockIdx.x, split = blockIdx.y;
    const int start = split * chunk, end = min(len, start + chunk);
    const int t = threadIdx.x, lane = t % WARP, warp = t / WARP;
    // The pages of positions tile .. min(end, tile + ATTN_TILE) - 1 go to tile_pages[0 ..].
    auto tile_page_count = [&](int tile) { return (min(end, tile + ATTN_TILE) - 1) / KV_PAGE - tile / KV_PAGE + 1; };
    const bool loads_first_page = start < end && t < tile_page_count(start);
    const int first_page = loads_first_page ? pages[start / KV_PAGE + t] : 0;
    wait_previous();
    if (start >= end) return;
    if (loads_first_page) tile_pages[t] = first_page;
    {
        float qv[GQA];  // thread t loads dimension t of each head: all loads in flight at once
#pragma unroll
        for (int h = 0; h < GQA; h++) qv[h] = q[(kv_head * GQA + h) * HEAD_DIM + t];
#pragma unroll
        for (int h = 0; h < GQA; h++) qs[q_at(t) + h] = qv[h];
    }
    if (t < GQA) run_max[t] = -INF_F, run_sum[t] = 0.f;
    float acc[GQA][8];
#pragma unroll
    for (int h = 0; h < GQA; h++)
#pragma unroll
        for (int j = 0; j < 8; j++) acc[h][j] = 0.f;
    __syncthreads();

    for (int tile = start; tile < end; tile += ATTN_TILE) {
        const int page0 = tile / KV_PAGE;
        if (tile != start) {
            // The previous tile's readers of tile_pages are past the loop's closing barrier.
            if (t < tile_page_count(tile)) tile_pages[t] = pages[page0 + t];
            __syncthreads();
        }
        if (end - start <= SCORE_ROWS)
            score_quartered(qs, k_pool, tile_pages, kv_head, tile, end, p);
        else
            score_whole(qs, k_pool, tile_pages, kv_head, tile, end, p);
        __syncthreads();
        // Warp h: the tile's max for head h, the new running max, and the rescale of what came before.
        {
            const int h = warp;
            float m = -INF_F;
            for (int i = lane; i < ATTN_TILE; i += WARP) m = fmaxf(m, p[i][h]);
            m = warp_max(m);
            const float new_max = fmaxf(run_max[h], m);
            float sum = 0.f;
            for (int i = lane; i < ATTN_TILE; i += WARP) {
                const float e = p[i][h] == -INF_F ? 0.f : expf(p[i][h] - new_max);
                p[i][h] = e;
                sum += e;
            }
            sum = warp_sum(sum);
            __syncwarp();
            if (lane == 0) {
                const float r = run_max[h] == -INF_F ? 0.f : expf(run_max[h] - new_max);
                rescale[h] = r;
                run_sum[h] = run_sum[h] * r + sum;
                run_max[h] = new_max;
            }
        }
        __syncthreads();
        // Values: warp w takes the tile's positions w, w + WARPS, ...; lane l owns dimensions 8l .. 8l + 7 of the GQA
        // heads' outputs, one 16-byte load of a value row each, many rows in flight.
#pragma unroll
        for (int h = 0; h < GQA; h++)
#pragma unroll
            for (int j = 0; j < 8; j++) acc[h][j] *= rescale[h];
        const int n = min(ATTN_TILE, end - tile);
        const bf16* vrows = v_pool + kv_head * HEAD_DIM + 8 * lane;
#pragma unroll 4
        for (int i = warp; i < n; i += ATTN_WARPS) {
            const int pos = tile + i;
            const size_t at = ((size_t)tile_pages[pos / KV_PAGE - page0] * KV_PAGE + pos % KV_PAGE) * KV_DIM;
            const uint4 raw = *(const uint4*)(vrows + at);
            const u32 v2[4] = {raw.x, raw.y, raw.z, raw.w};
            float v[8];
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const float2 f = pair_to_float2(v2[e]);
                v[2 * e] = f.x, v[2 * e + 1] = f.y;
            }
            const float4 pa = *(const float4*)&p[i][0], pb = *(const float4*)&p[i][4];
            const float ph[GQA] = {pa.x, pa.y, pa.z, pa.w, pb.x, pb.y, pb.z, pb.w};
#pragma unroll
            for (int h = 0; h < GQA; h++)
#pragma unroll
                for (int j = 0; j < 8; j++) acc[h][j] = fmaf(ph[h], v[j], acc[h][j]);
        }
        __syncthreads();
    }
    // The warps' sums, one head at a time through shared memory; thread t writes dimension t.
#pragma unroll
    for (int h = 0; h < GQA; h++) {
        *(float4*)&red[warp][8 * lane] = make_float4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]);
        *(float4*)&red[warp][8 * lane + 4] = make_float4(acc[h][4], acc[h][5], acc[h][6], acc[h][7]);
        __syncthreads();
        float o = 0.f;
#pragma unroll
        for (int w = 0; w < ATTN_WARPS; w++) o += red[w][t];
        part_o[((size_t)(kv_head * GQA + h) * ATTN_SPLITS + split) * HEAD_DIM + t] = o;
        __syncthreads();
    }
    if (t < GQA) {
        const int qh = kv_head * GQA + t;
        part_ml[(qh * ATTN_SPLITS + split) * 2] = run_max[t];
        part_ml[(qh * ATTN_SPLITS + split) * 2 + 1] = run_sum[t];
    }
}

// Grid (N_HEADS, HEAD_DIM / WARP, rows): a block merges the parts for one query head's 32-dimension slice, lane =
// dimension; warp w takes parts w, w + MERGE_WARPS, ... against the maximum over all parts, and the warps' sums
// meet in shared memory. Then the output gate: attn = o * sigmoid(gate), written as f32 to `attn` and as bf16 to
// `attn_bf16` (the batched step's o_proj input), each when not null.
#define MERGE_WARPS 8
extern "C" __global__ void __launch_bounds__(MERGE_WARPS * WARP)
    attn_merge(const int* positions, int splits, const float* part_o, const float* part_ml, const float* proj,
               float* attn, bf16* attn_bf16) {
    wait_previous();
    __shared__ float warp_max_s[MERGE_WARPS];
    __shared__ float num_s[MERGE_WARPS][WARP];
    __shared__ float den_s[MERGE_WARPS];
    const int row = blockIdx.z;
    const int len = positions[row] + 1;
    part_o += row * PART_O_ROW;
    part_ml += row * PART_ML_ROW;
    proj += (size_t)row * PROJ_ROW;
    const int parts = (len + attn_chunk(len, splits) - 1) / attn_chunk(len, splits);
    const int qh = blockIdx.x, lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int d = blockIdx.y * WARP + lane;
    const float* ml = part_ml + (size_t)qh * ATTN_SPLITS * 2;
    float mx = -INF_F;
    for (int s = threadIdx.x; s < parts; s += MERGE_WARPS * WARP) mx = fmaxf(mx, ml[2 * s]);
    mx = warp_max(mx);
    if (lane == 0) warp_max_s[warp] = mx;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < MERGE_WARPS; w++) mx = fmaxf(mx, warp_max_s[w]);
    float num = 0.f, den = 0.f;
#pragma unroll 4
    for (int s = warp; s < parts; s += MERGE_WARPS) {
        const float weight = expf(ml[2 * s] - mx);
        num += weight * part_o[((size_t)qh * ATTN_SPLITS + s) * HEAD_DIM + d];
        den += weight * ml[2 * s + 1];
    }
    num_s[warp][lane] = num;
    if (lane == 0) den_s[warp] = den;
    __syncthreads();
    if (warp == 0) {
        float n = 0.f, total = 0.f;
#pragma unroll
        for (int w = 0; w < MERGE_WARPS; w++) n += num_s[w][lane], total += den_s[w];
        const float gate = proj[qh * 2 * HEAD_DIM + HEAD_DIM + d];
        const float y = n / total * sigmoidf_(gate);
        const size_t at = (size_t)row * Q_DIM + qh * HEAD_DIM + d;
        if (attn) attn[at] = y;
        if (attn_bf16) attn_bf16[at] = float_to_bf16(y);
    }
}
